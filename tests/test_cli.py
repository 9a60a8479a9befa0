import subprocess
import sys

from attnlab.cli import main


def test_params_prints_table_and_exact_total(capsys):
    assert main(["params", "paper-base"]) == 0
    out = capsys.readouterr().out
    assert "63,082,496" in out and "rule of thumb" in out and "encoder.layers.*.self_attn" in out


def test_params_from_config_json(tmp_path, capsys):
    from attnlab import get_preset
    get_preset("llama-mini").to_json(tmp_path / "config.json")
    assert main(["params", str(tmp_path / "config.json")]) == 0
    assert "decoder.layers.*.self_attn" in capsys.readouterr().out


def test_shapes_lists_every_stage(capsys):
    assert main(["shapes", "mt-tiny"]) == 0
    out = capsys.readouterr().out
    assert "src_embed.position" in out and "decoder.layers.1.cross_attn" in out
    assert "lm_head" in out and "(2, 9, 1000)" in out


def test_bad_config_is_a_clear_error(capsys):
    assert main(["params", "no-such-preset"]) == 1  # a user error: 1; a usage error (bad flag value): 2
    assert "unknown preset 'no-such-preset'" in capsys.readouterr().err


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "attnlab", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "params" in out.stdout


def test_commands_start_without_importing_torch_dynamo():
    """torch._dynamo takes ~1.5 s to import, most of a command's start: `import attnlab` and an eager forward
    must not pull it in. attention.py marks its CPU check (a /proc/cpuinfo read) constant for torch.compile by hand
    instead; the mark must work as torch.compiler.assume_constant_result's: a whole graph around the check
    (fullgraph=True fails on the file read it would otherwise trace)."""
    code = ("import sys, torch, attnlab.cli\n"
            "from attnlab import TransformerConfig, build_model\n"
            "from attnlab.model import attention\n"
            "m = build_model(TransformerConfig(family='decoder-only', vocab_size=11, d_model=16, n_heads=2,\n"
            "                                  n_decoder_layers=1, d_ff=32)).eval()\n"
            "m(torch.randint(0, 11, (1, 5)))\n"
            "before = 'torch._dynamo' in sys.modules\n"
            "f = torch.compile(lambda x: x + attention._cpu_bf16_native(), backend='eager', fullgraph=True)\n"
            "print(before, f(torch.zeros(1)).item() == float(attention._cpu_bf16_native()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


def test_flag_out_of_range_is_a_usage_error(capsys):
    import pytest
    with pytest.raises(SystemExit) as e:
        main(["translate", "--model", "x", "--beam", "0"])
    assert e.value.code == 2 and "--beam: 0 is out of range: must be >= 1" in capsys.readouterr().err


def test_internal_error_is_one_line_with_debug_hint(monkeypatch, capsys):
    import attnlab.cli.params as params

    def boom(args):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(params, "run", boom)
    assert main(["params", "mt-tiny"]) == 1
    err = capsys.readouterr().err
    assert "internal error: ZeroDivisionError" in err and "rerun with --debug" in err and "Traceback" not in err
    import pytest
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "params", "mt-tiny"])


def test_doctor_reports_paths(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "PyTorch" in out and "CPU inference linears, bf16" in out and "train --bf16 on CPU" in out and "GELU, training" in out
    assert main(["doctor", "--json"]) == 0
    import json
    r = json.loads(capsys.readouterr().out)
    assert {"torch", "cpu_flags", "bf16_native_cpu", "packed_linear_bf16", "compile_cpu", "threads",
            "own_quant_kernels", "own_quant_kernels_compiled", "own_dropout_kernel", "own_gelu_kernel", "own_attention_kernel", "own_linear_kernel", "own_clip_kernel", "training_heap_refused"} <= set(r)
    from attnlab import doctor  # one table names the kernels the report asks about and the ones the doctor builds
    assert {k for k in r if k.startswith("own_")} == {*doctor.OWN_KERNELS, "own_quant_kernels_compiled"}
    assert doctor.KERNEL_PROBES == tuple(doctor.OWN_KERNELS.values())


def test_doctor_says_whether_training_keeps_freed_memory(capsys, monkeypatch):
    from attnlab import accel
    monkeypatch.setenv("ATTNLAB_KEEP_FREED_MEMORY", "0")
    assert main(["doctor"]) == 0
    assert "freed memory, training (CPU)  the C library's default heap: ATTNLAB_KEEP_FREED_MEMORY=0" in capsys.readouterr().out
    monkeypatch.delenv("ATTNLAB_KEEP_FREED_MEMORY")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert accel.heap_setting_refused() == "glibc's malloc is set by the environment (MALLOC_*_ or GLIBC_TUNABLES)"
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    if accel.heap_setting_refused() is None:  # glibc, nothing preloaded
        assert main(["doctor"]) == 0
        assert f"kept in the heap for the next step (glibc {accel.glibc_version()} mallopt)" in capsys.readouterr().out


def test_doctor_says_whose_quantised_kernels_run(capsys, monkeypatch):
    from attnlab import quant
    monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "0")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "--quantize, decoding (CPU)    PyTorch's int8/int4 kernels" in out and "ATTNLAB_OWN_KERNELS=0" in out
    assert "dropout, training (CPU)       torch operations" in out
    monkeypatch.delenv("ATTNLAB_OWN_KERNELS")
    monkeypatch.setattr(quant, "own_kernels", lambda: True)
    monkeypatch.setattr(quant, "own_kernels_in_compiled_step", lambda: False)
    assert main(["doctor"]) == 0
    assert "attnlab's own AVX2 kernels (eager); compiled step: inductor's GEMM" in capsys.readouterr().out


def test_doctor_builds_the_kernels_side_by_side_once(tmp_path, monkeypatch):
    """doctor.build_kernels: every probe it names is a function of attnlab's; it runs each in a process of its own,
    ``jobs`` at a time (here stand-in probes that record when they ran), then stamps torch's extension folder with this
    environment's kernel libraries there, so that the next doctor runs none, unless one of those libraries was built
    again since (its source changed, say; another environment's builds, in folders of their own, do not count); a
    probe that fails leaves no stamp; ATTNLAB_OWN_KERNELS=0 builds nothing."""
    import importlib
    import json
    import os
    from pathlib import Path
    from attnlab import accel, doctor
    monkeypatch.delenv("ATTNLAB_OWN_KERNELS", raising=False)  # (the suite also runs with every fast path off)
    for probe in doctor.KERNEL_PROBES:
        module, name = probe.split(":")
        assert callable(getattr(importlib.import_module(module), name)), probe
    if not (accel.can_build_kernels() and sys.platform.startswith("linux")):
        assert doctor.build_kernels() is False
        return
    (tmp_path / "probes.py").write_text(
        "import json, os, sys, time\n"
        "def ran(name):\n"
        "    start = time.time(); time.sleep(1.5)\n"
        f"    open(os.path.join({str(tmp_path)!r}, name + '.json'), 'w').write(json.dumps([start, time.time()]))\n"
        "def a(): ran('a')\ndef b(): ran('b')\ndef c(): ran('c')\ndef broken(): sys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))  # (the stamp's key reads the probes' own module too)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    library = Path(accel.kernel_build_directory("attnlab_x")) / "attnlab_x.so"  # (a kernel built before)
    library.write_bytes(b"")
    other = tmp_path / "ext" / "attnlab_x-0123456789ab" / "attnlab_x.so"  # another environment's build
    other.parent.mkdir()
    other.write_bytes(b"")
    stamps = lambda: list((tmp_path / "ext").glob("attnlab_kernels_*.built"))  # noqa: E731
    monkeypatch.setattr(doctor, "KERNEL_PROBES", ("probes:a", "probes:b", "probes:c"))
    assert doctor.build_kernels(jobs=2) is True and len(stamps()) == 1
    (a0, a1), (b0, b1), (c0, c1) = (json.loads((tmp_path / f"{k}.json").read_text()) for k in "abc")
    assert b0 < a1 and a0 < b1  # a and b side by side
    assert c0 >= min(a1, b1) - 0.05  # c only once one of them had ended (2 at a time)
    (tmp_path / "a.json").unlink()
    assert doctor.build_kernels() is False and not (tmp_path / "a.json").exists()  # stamped: nothing runs
    os.utime(library, ns=(library.stat().st_atime_ns, library.stat().st_mtime_ns + 10 ** 9))  # built again
    monkeypatch.setattr(doctor, "KERNEL_PROBES", ("probes:a",))
    assert doctor.build_kernels() is True and (tmp_path / "a.json").exists()
    assert doctor.build_kernels() is False  # (stamped again)
    os.utime(other, ns=(other.stat().st_atime_ns, other.stat().st_mtime_ns + 10 ** 9))  # built again elsewhere
    (tmp_path / "a.json").unlink()
    assert doctor.build_kernels() is False and not (tmp_path / "a.json").exists()  # leaves this one's stamp standing
    stamps()[0].unlink()
    monkeypatch.setattr(doctor, "KERNEL_PROBES", ("probes:a", "probes:broken"))
    assert doctor.build_kernels() is True and stamps() == []
    monkeypatch.setenv("ATTNLAB_OWN_KERNELS", "0")
    assert doctor.build_kernels() is False


def test_dry_run_checks_flags_without_running(capsys):
    assert main(["--dry-run", "train", "--train", "missing.tsv", "--minutes", "3"]) == 0
    assert "nothing was run" in capsys.readouterr().out


def test_a_flag_of_another_task_is_a_usage_error(capsys):
    assert main(["train", "--train", "x.txt", "--task", "classify", "--block-size", "64"]) == 2
    assert "--block-size is an option of --task lm only (this run is --task classify)" in capsys.readouterr().err


def test_task_choices_and_groups_come_from_the_registry(capsys):
    from attnlab.train.tasks import TASKS
    import pytest
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in TASKS) and "--task lm only:" in out and "--task classify only:" in out


def test_resume_continues_in_its_own_directory(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "training_args.json").write_text('{"task": "translation", "out": "elsewhere"}')
    assert main(["train", "--resume", str(run), "--out", str(tmp_path / "other")]) == 2
    assert f"--resume {run} continues that run in {run}; drop --out" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_demo_test_budget_caps_the_dev_sentences_too(tmp_path, monkeypatch):
    """attnlab demo --test-sentences N also scores at most N dev sentences at training's evaluations (an untrained
    model decodes each to its length limit: the demo's 200 took ~6 s of a 0.1-minute run); without it, the recipe's."""
    import attnlab.train
    from attnlab.demo import DEMO_RECIPE
    seen = []

    class Stop(Exception):
        pass

    class RecordingTrainer:
        def __init__(self, args, log=None):
            seen.append(args.eval_sentences)
            raise Stop

    monkeypatch.setattr(attnlab.train, "Trainer", RecordingTrainer)
    for extra, expected in ((["--test-sentences", "10"], 10), (["--test-sentences", "5000"], DEMO_RECIPE["eval_sentences"]),
                            ([], DEMO_RECIPE["eval_sentences"])):
        assert main(["demo", "--out", str(tmp_path / "demo"), "--device", "cpu", *extra]) == 1  # (Stop: an error)
        assert seen[-1] == expected, extra
    assert len(seen) == 3
