"""The training tasks, one module each, behind one contract (``base.Task``). ``TASKS`` is the registry
the trainer and the CLI's ``--task`` choices read."""

from .base import DataPosition, ListBatches, Task, label_smoothed_loss
from .classify import ClassificationTask
from .image_classify import ImageClassificationTask
from .lm import LanguageModelTask
from .mlm import MaskedLMTask
from .span import SpanCorruptionTask
from .translation import TranslationTask

TASKS: dict[str, type[Task]] = {t.name: t for t in (TranslationTask, LanguageModelTask, ClassificationTask,
                                                     MaskedLMTask, ImageClassificationTask, SpanCorruptionTask)}

__all__ = ["TASKS", "Task", "DataPosition", "ListBatches", "label_smoothed_loss", "TranslationTask",
           "LanguageModelTask", "ClassificationTask", "MaskedLMTask", "ImageClassificationTask",
           "SpanCorruptionTask"]
