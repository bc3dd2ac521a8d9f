"""`hf-sanity run -- CMD` and `hf-sanity preflight -- CMD` (hf_sanity/launch): the user's own training command,
unchanged, with SanityCallback on every Trainer it builds, or preflight on that trainer where its training would
start.

In-process: the anchor every Trainer gets attaches one callback (the user's respected), preflight replaces
``train`` on that trainer object only, the folders ``Trainer.__init__`` created are removed, and the callback's
pass-through frames leave the user's traceback as it is without hf-sanity. As a user runs it (slow): TRL's own CLI
(``trl sft/dpo/kto/reward/grpo``) on tiny local models and files, a plain Trainer script under ``torchrun``
(2 processes, gloo), crashes, signals, a command that builds no trainer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from dist import tinytrain as tt

from helpers import assert_one_line_error, cli
from hf_sanity.launch import hook, protocol, tracebacks

SCRIPT = Path(__file__).parent / "dist" / "launched.py"
BIN = Path(sys.executable).parent


@pytest.fixture
def launched(tmp_path, monkeypatch):
    """This process as one of a command's: the anchor in Trainer's default callbacks, with the settings given."""
    import transformers.trainer as trainer_module

    def start(mode: str = "run", **options) -> protocol.Settings:
        exchange = tmp_path / "exchange"
        exchange.mkdir(exist_ok=True)
        settings = protocol.Settings(mode=mode, exchange=str(exchange), **options)
        monkeypatch.setattr(hook, "_settings", settings)
        monkeypatch.setattr(hook, "_anchors", [])
        defaults = [*trainer_module.DEFAULT_CALLBACKS, hook.HfSanityLaunch]
        monkeypatch.setattr(trainer_module, "DEFAULT_CALLBACKS", defaults)
        return settings

    return start


def names(trainer) -> list[str]:
    return [type(cb).__name__ for cb in trainer.callback_handler.callbacks]


# -- in-process --------------------------------------------------------------------------------------------------
def test_the_settings_travel_by_environment_and_a_foreign_version_is_refused(tmp_path):
    settings = protocol.Settings(mode="run", exchange=str(tmp_path), abort_on="error", select=("training",))
    env = settings.child_environment({"PYTHONPATH": "/theirs", "HOME": "/home/u"})
    assert (
        env["PYTHONPATH"] == os.pathsep.join([str(tmp_path / "site"), "/theirs"]) and env["HOME"] == "/home/u"
    )
    assert protocol.Settings.from_env(env) == settings
    assert protocol.Settings.from_env({}) is None
    env[protocol.ENV] = json.dumps({"version": 0, "mode": "run", "exchange": "x"})
    with pytest.raises(ValueError, match="launch protocol 0"):
        protocol.Settings.from_env(env)


def test_the_anchor_attaches_one_callback_where_the_users_would_be_and_sends_the_report(launched, tmp_path):
    settings = launched("run", abort_on="error")
    trainer = tt.trainer(tmp_path / "out", max_steps=4)
    assert names(trainer)[:3] == ["DefaultFlowCallback", "HfSanityLaunch", "SanityCallback"]
    (anchor,) = hook._anchors
    assert anchor.trainer is trainer and anchor.sanity is anchor.added and anchor.sanity.abort_on == "error"
    trainer.train()
    # SanityCallback moved itself right after DefaultFlowCallback (it reads the flow's should_log); the anchor is
    # after it, so its on_train_end sends the finished report.
    assert names(trainer)[:3] == ["DefaultFlowCallback", "SanityCallback", "HfSanityLaunch"]
    (record,) = protocol.received(settings.exchange, "report")
    assert record["trainer"] == "Trainer" and record["finished"] is True and record["rank"] == 0
    assert record["report"]["findings"] == [] and record["state"]["global_step"] == 4
    (attached,) = protocol.received(settings.exchange, "attached")
    assert attached["callback"] == "added" and attached["world_size"] == 1


def test_the_users_callback_is_respected_never_a_second_one(launched, tmp_path):
    from hf_sanity import SanityCallback

    launched("run", abort_on="error")
    theirs = SanityCallback(print_findings=False)
    trainer = tt.trainer(tmp_path / "out", callbacks=[theirs], max_steps=2)
    assert names(trainer).count("SanityCallback") == 1 and hook._anchors[0].sanity is theirs
    # One added after __init__ (as a framework's plugin does) replaces hf-sanity's before training starts.
    launched("run")
    trainer = tt.trainer(tmp_path / "out2", max_steps=2)
    later = SanityCallback(print_findings=False)
    trainer.add_callback(later)
    trainer.train()
    watching = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SanityCallback)]
    assert watching == [later] and later.report.stats["steps"] == 2 and hook._anchors[0].sanity is later


def test_preflight_replaces_train_on_that_trainer_object_only(launched, tmp_path):
    from transformers import Trainer

    launched("preflight")
    trainer = tt.trainer(tmp_path / "out", max_steps=2)
    (anchor,) = hook._anchors
    assert trainer.train == anchor.preflight and "SanityCallback" not in names(trainer)
    assert type(trainer).train is Trainer.train  # the class is left alone: another trainer trains as before
    # Trainer.__init__ created output_dir; preflight removes it when it leaves (it was not there before).
    assert (tmp_path / "out").is_dir() and anchor.folders.top == tmp_path / "out"
    anchor.folders.restore()
    assert not (tmp_path / "out").exists()


def test_the_folders_trainer_init_created_are_removed_and_the_users_kept(tmp_path):
    new = hook.Folders(tmp_path / "runs" / "exp" / "out")
    (tmp_path / "runs" / "exp" / "out" / "completions").mkdir(parents=True)
    new.restore()
    assert not (tmp_path / "runs").exists()  # every folder of the path that did not exist, empty: removed
    theirs = tmp_path / "theirs"
    (theirs / "checkpoint-5").mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    kept = hook.Folders(theirs)
    (theirs / "completions").mkdir()
    (theirs / "logs").mkdir()
    (theirs / "logs" / "written-by-the-command.txt").write_text("x")
    kept.restore()
    assert sorted(p.name for p in theirs.iterdir()) == ["checkpoint-5", "logs", "notes.txt"]


class MismatchedLoss(__import__("transformers").Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return __import__("torch").nn.functional.cross_entropy(outputs.logits, inputs["labels"])


def crash_frames(trainer) -> tuple[list[tuple[str, str, str | None]], str]:
    """The frames and message of the exception ``trainer.train()`` raises, after the launch's cleaning."""
    with pytest.raises(RuntimeError) as caught:
        trainer.train()
    tracebacks.clean(caught.value)
    frames = [
        (Path(f.filename).name, f.name, f.line) for f in traceback.extract_tb(caught.value.__traceback__)
    ]
    return frames, str(caught.value)


def test_a_crash_in_the_users_loss_shows_the_traceback_it_shows_without_hf_sanity(tmp_path):
    from hf_sanity import SanityCallback

    plain = crash_frames(tt.trainer(tmp_path / "a", cls=MismatchedLoss, max_steps=2))
    watched = tt.trainer(tmp_path / "b", cls=MismatchedLoss, max_steps=2, callbacks=[SanityCallback()])
    with pytest.raises(RuntimeError) as caught:
        watched.train()
    raw = [Path(f.filename).name for f in traceback.extract_tb(caught.value.__traceback__)]
    assert {"instrument.py", "broadcast.py"} <= set(raw)  # the wrappers the run went through
    watched = tt.trainer(tmp_path / "c", cls=MismatchedLoss, max_steps=2, callbacks=[SanityCallback()])
    assert crash_frames(watched) == plain
    assert "instrument.py" not in {frame[0] for frame in plain[0]}


def test_the_traceback_cleaning_is_installed_once_whoever_asks(monkeypatch):
    """The launch's hook and every SanityCallback that wraps a trainer's step ask for it: one hook, chained once
    to the one in place."""
    from hf_sanity.training.instrument import Instruments

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    tracebacks.install()
    first = sys.excepthook
    assert first is not sys.__excepthook__ and first.hf_sanity_cleans
    Instruments().install(None, None, None)
    tracebacks.install()
    assert sys.excepthook is first


def test_a_pass_through_frame_that_called_hf_sanitys_own_code_stays():
    """An error of hf-sanity's own code keeps every frame (a bug report needs them)."""
    from hf_sanity.training.instrument import Instruments, OwnClock

    class Observer:
        clock = OwnClock()
        before_micro = staticmethod(protocol.Settings.from_env)  # hf-sanity's code, raising on these inputs

    wrapped = Instruments()._training_step(lambda model, inputs: None, Observer())
    with pytest.raises(ValueError) as caught:
        wrapped(None, {protocol.ENV: json.dumps({"version": 0})})
    tracebacks.clean(caught.value)
    frames = [f.name for f in traceback.extract_tb(caught.value.__traceback__)]
    assert frames[1:] == ["training_step", "from_env"]


# -- as a user runs it: a plain Trainer script -------------------------------------------------------------------
def launch(*args, cwd, timeout: int = 600, **env) -> subprocess.CompletedProcess:
    """`hf-sanity ARGS...` as a user runs it (``env``: variables to set for it)."""
    return cli(*args, cwd=cwd, timeout=timeout, env={"COLUMNS": "160", **env})


def script(scenario: str, out) -> list[str]:
    return [sys.executable, str(SCRIPT), scenario, str(out)]


def report_of(path: Path) -> dict:
    return json.loads(path.read_text())


def frames(stderr: str) -> list[str]:
    """A printed traceback's frames, their source lines and the exception line."""
    lines = stderr.splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("Traceback"))
    block = [line for line in lines[start:] if line.startswith(("  File", "    "))]
    return block + [next(line for line in lines[start:] if re.match(r"^\w+Error", line))]


@pytest.mark.slow
def test_the_bootstrap_imports_nothing_when_the_command_never_imports_transformers(tmp_path):
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith(('hf_sanity','torch','transformers'))))"
    result = launch("run", "--", sys.executable, "-c", code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "[]"
    assert "nothing was checked" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_users_sitecustomize_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS'] = 'ran'\n")
    code = "import os, sitecustomize; print(os.environ.get('THEIRS'), sitecustomize.__file__)"
    result = launch(
        "run",
        "--",
        sys.executable,
        "-c",
        code,
        cwd=tmp_path,
        PYTHONPATH=f"{theirs}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    )
    assert result.stdout.split() == ["ran", str(theirs / "sitecustomize.py")], result.stderr


@pytest.mark.slow
def test_a_command_that_cannot_start_or_fails_passes_its_code_through(tmp_path):
    result = launch("run", "--", "no-such-command-hf-sanity", cwd=tmp_path)
    assert (
        result.returncode == 127
        and result.stderr.strip() == "hf-sanity: command not found: no-such-command-hf-sanity"
    )
    result = launch("run", "--", sys.executable, "-c", "raise SystemExit(3)", cwd=tmp_path)
    assert result.returncode == 3
    assert_one_line_error(launch("run", cwd=tmp_path), "pass your training command after --")
    assert_one_line_error(
        launch("run", "--abort-on", "sometimes", "--", "true", cwd=tmp_path), "--abort-on must be"
    )
    assert_one_line_error(
        launch("run", "--select", "nope", "--", "true", cwd=tmp_path), "unknown rule or stage 'nope'"
    )
    assert_one_line_error(
        launch("preflight", "--model", "m", "--max-len", "8", "--", "true", cwd=tmp_path),
        "--model, --max-len describe(s) a setup to load", "pass one or the other",
    )  # fmt: skip
    assert_one_line_error(launch("preflight", cwd=tmp_path), "Missing option '--model'", "preflight -- CMD")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_sent_to_hf_sanity_reaches_the_command_once(tmp_path, signum):
    code = (
        "import signal, sys, time, pathlib\n"
        "got = []\n"
        "signal.signal(signal.SIGINT, lambda n, f: got.append(n))\n"
        "signal.signal(signal.SIGTERM, lambda n, f: got.append(n))\n"
        "pathlib.Path('ready').write_text('1')\n"
        "deadline = time.time() + 60\n"
        "while not got and time.time() < deadline: time.sleep(0.05)\n"
        "time.sleep(0.5)\n"
        "pathlib.Path('got').write_text(repr(got))\n"
        "sys.exit(7)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_sanity.cli", "run", "--", sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not (tmp_path / "ready").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 7, err
    assert (tmp_path / "got").read_text() == repr(
        [int(signum)]
    )  # once: not also from hf-sanity's own handler


@pytest.mark.slow
@pytest.mark.planted("loss-diverged")
def test_a_script_that_trains_twice_gets_both_reports_together(tmp_path):
    runs, command = tmp_path / "runs", script("twice", tmp_path / "out")
    result = launch("run", "--json", tmp_path / "r.json", "--report", runs, "--", *command, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = report_of(tmp_path / "r.json")
    assert [t["trainer"] for t in report["stats"]["launch"]["trainers"]] == ["Trainer", "Trainer"]
    assert "the command trained 2 trainers" in report["notes"][0]
    diverged = [f for f in report["findings"] if f["rule"] == "loss-diverged"]
    assert diverged and {f["evidence"]["trainer"] for f in report["findings"]} == {"2: Trainer"}
    assert "watched 2 trainers (Trainer, Trainer)" in result.stdout
    for i in (1, 2):  # each trainer a run doctor reads
        assert (tmp_path / "runs" / f"trainer-{i}" / "trainer_state.json").is_file()
        assert (tmp_path / "runs" / f"trainer-{i}" / "hf-sanity" / "report.json").is_file()
    result = cli("doctor", tmp_path / "runs" / "trainer-1", tmp_path / "runs" / "trainer-2", cwd=tmp_path)
    assert result.returncode == 1 and "loss-diverged" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow
def test_the_users_own_callback_watches_and_reports(tmp_path):
    result = launch(
        "run", "--json", tmp_path / "r.json", "--", *script("yours", tmp_path / "out"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert report_of(tmp_path / "out" / "rank0.json")["trainer"].count("SanityCallback") == 1
    assert report_of(tmp_path / "r.json")["stats"]["steps"] == 8


@pytest.mark.slow
def test_a_crash_in_the_command_keeps_its_code_and_its_traceback(tmp_path):
    plain = subprocess.run(
        script("crash-loss", tmp_path / "plain"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    run = launch(
        "run", "--json", tmp_path / "r.json", "--", *script("crash-loss", tmp_path / "run"), cwd=tmp_path
    )
    assert plain.returncode == run.returncode == 1, run.stderr[-3000:]
    assert frames(run.stderr) == frames(plain.stderr) and "hf_sanity" not in "".join(frames(run.stderr))
    assert report_of(tmp_path / "r.json")["stats"]["aborted_by"] == "RuntimeError"  # what it saw until then
    # In Trainer's __init__ (before training), under preflight: the same traceback, and one line saying so.
    plain = subprocess.run(
        script("crash-init", tmp_path / "plain"), capture_output=True, text=True, cwd=tmp_path, timeout=600
    )
    result = launch("preflight", "--", *script("crash-init", tmp_path / "pf"), cwd=tmp_path)
    assert result.returncode == 2 and frames(result.stderr) == frames(plain.stderr)
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the command built BrokenSetup but exited (code 1) before it started training: nothing was checked"
    )


@pytest.mark.slow
def test_preflight_never_enters_train_and_leaves_the_output_folder_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    result = launch("preflight", "--json", tmp_path / "r.json", "--", *script("clean", out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before  # no checkpoint, no marker
    report = report_of(tmp_path / "r.json")
    assert report["findings"] == [] and report["stats"]["examples"] == 32
    result = launch("preflight", "--", *script("clean", tmp_path / "new" / "out"), cwd=tmp_path)
    assert result.returncode == 0 and not (tmp_path / "new").exists()  # Trainer.__init__ created it: removed
    for scenario, said in (("no-trainer", "without building a transformers Trainer"),
                           ("no-train", "built Trainer but exited (code 0) before it started training")):  # fmt: skip
        result = launch("preflight", "--", *script(scenario, tmp_path / scenario), cwd=tmp_path)
        assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
            "nothing was checked"
        ), result.stderr
        assert said in result.stderr


# -- torchrun: 2 processes, gloo, CPU ----------------------------------------------------------------------------
def torchrun(*args) -> list[str]:
    import socket

    with socket.socket() as sock:  # a free port, so that parallel runs do not collide
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        *map(str, args),
    ]


@pytest.mark.slow
@pytest.mark.clean("training", "curves", "tokens")
def test_run_under_torchrun_attaches_on_both_ranks_and_reports_once(tmp_path):
    out = tmp_path / "out"
    command = torchrun(SCRIPT, "clean", out)
    result = launch(
        "run", "--json", tmp_path / "r.json", "--report", tmp_path / "run", "--", *command, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):  # each rank's trainer had one SanityCallback, after DefaultFlowCallback
        assert report_of(out / f"rank{rank}.json")["trainer"][:3] == [
            "DefaultFlowCallback",
            "SanityCallback",
            "HfSanityLaunch",
        ]
    assert result.stdout.count("hf-sanity training:") == 1  # rank 0's report, printed once by hf-sanity
    report = report_of(tmp_path / "r.json")
    assert report["findings"] == [] and report["stats"]["world_size"] == 2 and report["stats"]["steps"] == 8
    assert report["stats"]["launch"]["ranks"] == [0, 1] and report["stats"]["launch"]["processes"] == 2
    assert (out / "after-train.txt").is_file()  # the command ran on, unchanged
    doctor = cli("doctor", tmp_path / "run", "--json", tmp_path / "d.json", cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert report_of(tmp_path / "d.json")["stats"]["runs"][0]["global_step"] == 8


@pytest.mark.slow
def test_preflight_under_torchrun_checks_each_rank_and_reports_once(tmp_path):
    result = launch(
        "preflight",
        "--json",
        tmp_path / "r.json",
        "--",
        *torchrun(SCRIPT, "clean", tmp_path / "out"),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = report_of(tmp_path / "r.json")
    assert report["stats"]["processes"] == 2 and report["stats"]["examples"] == 16  # rank 0's shard of 32
    assert result.stdout.count("hf-sanity preflight:") == 1 and not (tmp_path / "out").exists()


# -- TRL's own CLI: trl sft / dpo / kto / reward / grpo on tiny local models and files, offline -----------------
SHARED_OPENING = "Let me think about this carefully and answer in a complete sentence: "
# The flags every run shares (as tests/trl_setups.py's `common`): short, fp32, no checkpoints, a log every step.
COMMON = ["--max_steps", "6", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--report_to", "none",
          "--save_strategy", "no", "--bf16", "false", "--gradient_checkpointing", "false", "--seed", "0",
          "--use_cpu"]  # fmt: skip
RL = [
    "--num_generations",
    "4",
    "--max_completion_length",
    "24",
    "--temperature",
    "1.2",
    "--learning_rate",
    "1e-4",
]
REWARDS = '''
def text_of(completion):
    return completion[0]["content"] if isinstance(completion, list) else completion


def length_reward(completions, **kwargs):
    """Completions near 30 characters score best: it varies within a group."""
    return [-abs(len(text_of(c)) - 30) / 30 for c in completions]


def contains_answer(completions, answer, **kwargs):
    """The conversational bug: `in` on a list of messages is always False."""
    return [1.0 if a.split()[-1].rstrip(".") in c else 0.0 for c, a in zip(completions, answer)]
'''


@pytest.fixture(scope="module")
def trl_files(tmp_path_factory):
    """The data folders (``train.jsonl`` each, as `load_dataset(folder)` reads it) and the reward functions'
    module, in the folder the commands run from (`trl grpo` imports a dotted reward path from there)."""
    from hf_sanity.testing import (
        as_prompt_completion,
        demo_conversations,
        demo_preference_pairs,
        demo_rl_prompts,
        demo_unpaired,
    )

    root = tmp_path_factory.mktemp("trl-cli")
    opening = demo_preference_pairs(24)
    for pair in opening:  # chosen and rejected share a long opening: a short max_length leaves them identical
        for side in ("chosen", "rejected"):
            pair[side] = [{"role": "assistant", "content": SHARED_OPENING + pair[side][0]["content"]}]
    longer = demo_preference_pairs(32)
    for pair in longer:  # the chosen answer is always the longer one: length alone separates the pairs
        pair["chosen"][0]["content"] += " I hope this helps, and let me know if you need more."
    unpaired_long = demo_unpaired(48)
    for row in unpaired_long:  # a long opening to every answer: a short max_length cuts them all
        row["completion"] = [
            {"role": "assistant", "content": SHARED_OPENING + row["completion"][0]["content"]}
        ]
    data = {
        "sft": as_prompt_completion(demo_conversations(32), conversational=True),
        "pairs": demo_preference_pairs(32), "shared-opening": opening, "chosen-longer": longer,
        "unpaired": demo_unpaired(48), "sorted-by-label": sorted(demo_unpaired(48), key=lambda r: r["label"]),
        "unpaired-long": unpaired_long,
        "prompts": demo_rl_prompts(32, seed=3),
    }  # fmt: skip
    for name, rows in data.items():
        (root / name).mkdir()
        (root / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


def trl_command(trainer: str, data: Path, out: Path, *flags) -> list[str]:
    from hf_sanity.testing import tiny_model_dir, trained_model_dir

    # GRPO samples its completions: the tiny model fine-tuned to answer the demo chats and end its turn.
    model = trained_model_dir("clean") if trainer == "grpo" else tiny_model_dir("chatml", "distinct")
    lr = RL if trainer == "grpo" else ["--learning_rate", "1e-3"]
    return [str(BIN / "trl"), trainer, "--model_name_or_path", str(model), "--dataset_name", str(data),
            "--output_dir", str(out), *COMMON, *lr, *map(str, flags)]  # fmt: skip


def trl(mode: str, trainer: str, case: tuple, files: Path, tmp_path: Path, *options):
    """``hf-sanity MODE OPTIONS -- trl TRAINER ...`` on ``case`` (a data folder and flags), run from the folder of
    the files; (result, the JSON report, the output_dir given to the trainer)."""
    data, *flags = case
    out = tmp_path / "out"
    command = trl_command(trainer, files / data, out, *flags)
    result = launch(mode, *options, "--json", tmp_path / "r.json", "--", *command, cwd=files)
    report = report_of(tmp_path / "r.json") if (tmp_path / "r.json").is_file() else None
    assert report is not None, result.stdout + result.stderr[-3000:]
    return result, report, out


# Per trainer: the clean command's data folder and flags, then each mode's planted bug: its data and flags, and the
# rule it must be caught with and the evidence that names its cause. KTO's batches of one label (rows sorted by
# label) and a reward model's length-separable pairs are preflight rules; the runs get bugs a run shows: KTO's answers
# cut by the trainer's max_length (the first batch), a learning rate of 0 for the reward model (its one cause).
TRL_CASES = {
    "sft": {"clean": ("sft", "--max_length", 256),
            "preflight": (("sft", "--max_length", 36), ("truncated-completion", {"cause": "trainer-max-length"})),
            "run": (("sft", "--max_length", 36), ("truncated-completion", {"cause": "trainer-max-length"}))},
    "dpo": {"clean": ("pairs", "--max_length", 256),
            "preflight": (("shared-opening", "--max_length", 40), ("preference-pairs-identical", {"cause": "truncation"})),
            "run": (("shared-opening", "--max_length", 40), ("truncated-completion", {"cause": "trainer-max-length"}))},
    "kto": {"clean": ("unpaired", "--max_length", 256),
            "preflight": (("sorted-by-label", "--max_length", 256), ("preference-unmixed-batches", {"cause": "sorted-by-label"})),
            "run": (("unpaired-long", "--max_length", 40), ("truncated-completion", {"cause": "trainer-max-length"}))},
    "reward": {"clean": ("pairs", "--max_length", 256),
               "preflight": (("chosen-longer", "--max_length", 256), ("preference-trivially-separable", {"cause": "length"})),
               "run": (("pairs", "--max_length", 256, "--learning_rate", 0),
                       ("lr-zero", {"lr": 0, "warmup_steps": 0}))},
    "grpo": {"clean": ("prompts", "--reward_funcs", "rewards.length_reward"),
             "preflight": (("prompts", "--reward_funcs", "rewards.contains_answer"),
                           ("reward-function-broken", {"cause": "completion-type"})),
             "run": (("prompts", "--reward_funcs", "rewards.contains_answer"),
                     ("reward-function-broken", {"cause": "completion-type"}))},
}  # fmt: skip
TRAINER_CLASS = {"sft": "SFTTrainer", "dpo": "DPOTrainer", "kto": "KTOTrainer", "reward": "RewardTrainer",
                 "grpo": "GRPOTrainer"}  # fmt: skip


def planted(mode: str):
    """The TRL cases as parameters, each marked as the planted test of the rule ``mode`` must find."""
    return [
        pytest.param(name, marks=pytest.mark.planted(case[mode][1][0])) for name, case in TRL_CASES.items()
    ]


def rules_and_causes(report: dict) -> list[tuple[str, str | None]]:
    return [(f["rule"], f["evidence"].get("cause")) for f in report["findings"]]


def caught(report: dict, rule: str, evidence: dict) -> dict:
    """The finding of ``rule``, with ``evidence`` among its evidence."""
    found = [f for f in report["findings"] if f["rule"] == rule]
    assert found, rules_and_causes(report)
    assert {k: found[0]["evidence"].get(k) for k in evidence} == evidence, found[0]["evidence"]
    return found[0]


@pytest.mark.slow
# the stages every objective's run checks in 6 steps
@pytest.mark.clean("training", "trainer", "internal-error")
@pytest.mark.parametrize("trainer", list(TRL_CASES))
def test_a_clean_trl_cli_run_is_silent_and_never_stopped(trl_files, tmp_path, trainer):
    result, report, _ = trl(
        "run", trainer, TRL_CASES[trainer]["clean"], trl_files, tmp_path, "--abort-on", "error"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "--abort-on error: training stops after the step of the first finding of severity error"
        in result.stderr
    )
    assert rules_and_causes(report) == [] and report["stats"]["steps"] == 6
    assert "aborted_at_step" not in report["stats"]
    assert report["stats"]["launch"]["trainers"][0]["trainer"] == TRAINER_CLASS[trainer]
    assert "Training completed" in result.stdout  # the command ran on, unchanged


@pytest.mark.slow
@pytest.mark.parametrize("trainer", planted("run"))
def test_a_planted_bug_in_a_trl_cli_run_is_caught_with_its_cause(trl_files, tmp_path, trainer):
    case, (rule, evidence) = TRL_CASES[trainer]["run"]
    result, report, _ = trl("run", trainer, case, trl_files, tmp_path, "--abort-on", "error")
    assert result.returncode == 0, result.stderr[-3000:]
    found = caught(report, rule, evidence)
    if (
        found["severity"] == "error"
    ):  # stopped at once (lr-zero waits one step: a warmup starts at 0), not at 6
        stopped = report["stats"]["aborted_at_step"]
        assert report["stats"]["aborted_by"] == rule and report["stats"]["steps"] == stopped
        assert stopped <= max(found["step"], 1) + 1


@pytest.mark.slow
# the stages every objective's preflight checks (KTO's unpaired rows and GRPO's prompts run no data rule)
@pytest.mark.clean("tokens", "template", "model", "trainer", "internal-error")
@pytest.mark.parametrize("trainer", list(TRL_CASES))
def test_preflight_of_a_clean_trl_cli_command_is_silent_and_trains_nothing(trl_files, tmp_path, trainer):
    result, report, out = trl("preflight", trainer, TRL_CASES[trainer]["clean"], trl_files, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert rules_and_causes(report) == [] and "Training completed" not in result.stdout
    assert report["stats"]["launch"]["trainers"][0]["trainer"] == TRAINER_CLASS[trainer]
    assert not out.exists()  # the output_dir Trainer.__init__ created is removed: nothing was written there


@pytest.mark.slow
@pytest.mark.parametrize("trainer", planted("preflight"))
def test_preflight_of_a_trl_cli_command_catches_its_planted_bug(trl_files, tmp_path, trainer):
    case, (rule, evidence) = TRL_CASES[trainer]["preflight"]
    result, report, out = trl("preflight", trainer, case, trl_files, tmp_path)
    caught(report, rule, evidence)
    assert result.returncode == (1 if any(f["severity"] == "error" for f in report["findings"]) else 0)
    assert "Training completed" not in result.stdout and not out.exists()
