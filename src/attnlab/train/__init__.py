"""Training: the trainer, schedules, checkpoints."""
from .trainer import TrainArgs, Trainer, average_checkpoints, learning_rate

__all__ = ["TrainArgs", "Trainer", "average_checkpoints", "learning_rate"]
