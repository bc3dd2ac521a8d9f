"""The shape of the house, checked: one registry that every rule is wired into (a detector, a planted-bug test
and a clean test for each), imports that go one way, a context no rule can write to, and extra passes that
leave every module of the user's model as it was."""

from __future__ import annotations

import ast
import copy
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_sanity import catalog

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_sanity"
TESTS = ROOT / "tests"
GUARD_RULES = {"internal-error", "checks-skipped"}  # produced by the catalog's runner around every detector


# -- the registry ------------------------------------------------------------------------------------
def test_every_rule_has_a_detector():
    missing = [
        slug for slug, rule in catalog.load().items() if not rule.detectors and slug not in GUARD_RULES
    ]
    assert missing == []


def test_rule_modules_are_discovered():
    on_disk = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (PACKAGE / "rules").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert set(catalog.rule_modules()) == on_disk
    defined_in = {rule.module for rule in catalog.load().values()}
    assert defined_in - {"hf_sanity.catalog"} <= on_disk


def marked(name: str) -> dict[str, list[str]]:
    """``{test id: [marker arguments]}`` of every ``@pytest.mark.<name>(...)`` in the test files (read from the
    source, so the answer does not depend on which tests this run selected)."""
    out: dict[str, list[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                func = deco.func if isinstance(deco, ast.Call) else None
                if (
                    isinstance(func, ast.Attribute)
                    and func.attr == name
                    and ast.unparse(func.value) == "pytest.mark"
                ):
                    out[f"{path.name}::{node.name}"] = [ast.literal_eval(a) for a in deco.args]
    return out


def covered(selectors: list[str]) -> set[str]:
    rules = catalog.load()
    out: set[str] = set()
    for selector in selectors:
        if selector == "ALL":
            out |= set(rules)
        elif selector in catalog.STAGES:
            out |= {slug for slug, rule in rules.items() if rule.stage == selector}
        else:
            assert selector in rules, f"unknown rule {selector!r} in a test marker"
            out.add(selector)
    return out


def test_every_rule_has_a_planted_bug_test():
    planted = {slug for slugs in marked("planted").values() for slug in covered(slugs)}
    assert sorted(set(catalog.load()) - planted) == []


def test_every_rule_has_a_clean_test_that_names_it():
    """A clean test counts for a rule only where it names the rule: a stage or ALL says the rules that ran
    stayed silent, not that a given rule ran (conftest's runtime check fails a test whose named rule's
    detector did not run: not written for the test's objective, or nothing to check on its input)."""
    rules = catalog.load()
    named = {s for selectors in marked("clean").values() for s in selectors if s in rules}
    for selectors in marked("clean").values():
        covered(selectors)  # every selector is a rule, a stage or ALL
    assert sorted(set(rules) - named - GUARD_RULES) == []


CONFTEST = """
import importlib.util
import sys

sys.path.insert(0, {tests!r})
spec = importlib.util.spec_from_file_location("project_conftest", {tests!r} + "/conftest.py")
project = importlib.util.module_from_spec(spec)
spec.loader.exec_module(project)
pytest_runtest_call = project.pytest_runtest_call
pytest_runtest_setup = project.pytest_runtest_setup
pytest_terminal_summary = project.pytest_terminal_summary


def pytest_configure(config):
    config.addinivalue_line("markers", "clean(*selectors): rules that must stay silent")
"""
CLEAN_MARKERS = """
import pytest

from hf_sanity import catalog
from hf_sanity.measure.curves import Curves


def analyzed(**select):
    from hf_sanity.drivers.curves import analyze
    from hf_sanity.selection import Selection

    curves = Curves(train_steps=list(range(1, 41)), train_loss=[3.0 - 0.05 * i for i in range(40)])
    return analyze(curves, final=True, selection=Selection.build(**select))


@pytest.mark.clean("loss-diverged")
def test_names_a_rule_that_ran():
    assert analyzed(select="loss-diverged") == []


@pytest.mark.clean("loss-diverged")
def test_names_a_rule_not_selected():
    assert analyzed(select="overfitting") == []


@pytest.mark.clean("curves")
def test_names_a_stage_nothing_of_which_ran():
    pass


@pytest.mark.clean("never-stops")
def test_names_a_rule_a_subprocess_ran():
    import subprocess, sys

    code = "from hf_sanity import catalog; catalog.note_ran(['never-stops'])"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_needs_a_real_tokenizer():
    import conftest

    conftest.project.real_tokenizer("gpt2")
"""


@pytest.mark.slow
def test_a_clean_marker_whose_rule_did_not_run_fails_its_test(tmp_path):
    """conftest's runtime check, on a test file of its own: a marked rule whose detector ran (here, or in a
    process the test started) passes; one not selected, and a stage none of whose rules ran, fail, naming it.
    A test that needs the real tokenizers where they are absent skips, and the summary says so out loud."""
    (tmp_path / "conftest.py").write_text(CONFTEST.format(tests=str(TESTS)))
    (tmp_path / "test_markers.py").write_text(CLEAN_MARKERS)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", "-rfs",
         "-o", "addopts=", "test_markers.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
             "HF_SANITY_REAL_TOKENIZERS": str(tmp_path / "absent"), "COLUMNS": "400"},
    )  # fmt: skip
    out = result.stdout
    assert "2 failed, 2 passed, 1 skipped" in out, out + result.stderr
    failed = {line.split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {"FAILED test_markers.py::test_names_a_rule_not_selected",
                      "FAILED test_markers.py::test_names_a_stage_nothing_of_which_ran"}  # fmt: skip
    assert "@pytest.mark.clean names loss-diverged, whose detector did not run in this test" in out
    assert "@pytest.mark.clean names curves, whose detector did not run" in out
    assert "!!! real tokenizers absent !!!" in out
    assert f"1 test(s) skipped: no real tokenizers at {tmp_path / 'absent'}" in out
    assert f"real tokenizers absent: {tmp_path / 'absent' / 'gpt2'} is not there" in out  # the skip's reason
    assert "set HF_SANITY_REAL_TOKENIZERS=<folder>" in out


def test_online_detectors_are_the_step_monitors_and_the_online_curve_detectors():
    online = {d.kind for d in catalog.detectors("step") + catalog.detectors("curve", online=True)}
    assert online == {"step", "curve"}
    assert all(d.online for d in catalog.detectors("step"))


# -- imports go one way --------------------------------------------------------------------------------
def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


OURS = ("hf_sanity", "benchmarks")  # the packages whose imports are checked (tests and recipes import them)
IMPORT_KINDS = ("module", "function", "type")  # at import, in a function body, under ``if TYPE_CHECKING:``


def labelled_import_graph() -> dict[str, dict[str, set[str]]]:
    """``{module: {imported module: the kinds of its imports of it}}`` for every module of hf_sanity and
    benchmarks, plus the packages an import runs on the way (importing ``a.b.c`` runs ``a.b``'s ``__init__``).
    Each import is labelled with its kind, :data:`IMPORT_KINDS`: a module-level one runs at import, a
    function-level one when the function first runs, a type-only one never, yet it still ties the two
    modules' designs together."""
    modules = {module_name(p): p for package in OURS for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, dict[str, set[str]]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        top_level = {id(n) for n in tree.body}
        targets: dict[str, set[str]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
                found = {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                found = {a.name for a in node.names if a.name.split(".")[0] in OURS}
            else:
                continue
            kind = "type" if id(node) in typing_only else "module" if id(node) in top_level else "function"
            for target in found:
                parts = target.split(".")
                for i in range(2, len(parts) + 1):  # the packages on the way
                    targets.setdefault(".".join(parts[:i]), set()).add(kind)
        # A module's own enclosing packages are initialised before it, whatever it imports: not an edge.
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        graph[name] = {
            t: kinds for t, kinds in targets.items() if t in modules and t != name and t not in own
        }
    return graph


def import_graph() -> dict[str, set[str]]:
    """Every import of hf_sanity's modules of each other that runs: module-level and function-level ones."""
    return {
        name: {t for t, kinds in targets.items() if kinds - {"type"} and t.startswith("hf_sanity")}
        for name, targets in labelled_import_graph().items()
        if name.startswith("hf_sanity")
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    cycles = []
    for group in groups:  # the shortest path from the group's first module back to it
        start, members = group[0], set(group)
        came_from: dict[str, str] = {}
        queue, end = [start], None
        while queue and end is None:
            node = queue.pop(0)
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    end = node
                    break
                if nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
        path = [end]
        while path[-1] != start:
            path.append(came_from[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def test_the_import_graph_sees_every_kind_of_import():
    """The check below reads what it claims to: each kind of import is in the graph (an ast walk that missed
    function bodies once hid a cycle)."""
    graph = labelled_import_graph()
    assert graph["hf_sanity.report"]["hf_sanity.findings"] == {"module"}
    assert "type" in graph["hf_sanity.findings"]["hf_sanity.remedies"]
    assert "function" in graph["benchmarks.run"]["benchmarks.callback_overhead"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_hf_sanity_or_the_benchmarks():
    """No two modules import each other, by any path and any kind of import (module-level, function-level or
    type-only): no exceptions."""
    labelled = labelled_import_graph()
    cycles = import_cycles({name: set(targets) for name, targets in labelled.items()})
    described = [
        " -> ".join(
            [path[0]] + [f"({'/'.join(sorted(labelled[a][b]))}) {b}" for a, b in itertools.pairwise(path)]
        )
        for path in cycles
    ]
    assert described == []


def test_rules_read_the_measurement_core_not_the_drivers():
    graph = import_graph()
    drivers = (
        "hf_sanity.drivers",
        "hf_sanity.training",
        "hf_sanity.protocol",
        "hf_sanity.callback",
        "hf_sanity.cli",
    )
    for name, targets in graph.items():
        if name.startswith(("hf_sanity.rules", "hf_sanity.measure")):
            assert not [t for t in targets if t.startswith(drivers)], name


def test_measurement_imports_no_rule_module():
    """Measurement reads the data and the model; judgement reads measurements. The TRL metric readers are
    measurement too: what they compute a rule judges, so none of them may import a rule module."""
    graph = import_graph()
    readers = [n for n in graph if n.startswith("hf_sanity.measure") or n == "hf_sanity.training.trl_metrics"]
    assert "hf_sanity.training.trl_metrics" in readers
    assert {n: sorted(t for t in graph[n] if t.startswith("hf_sanity.rules")) for n in readers} == {
        n: [] for n in readers
    }


# What runs the model, by the name it is called by: a forward (``model(...)``, ``trainer.model(...)``,
# ``peft_model(...)``, ``.forward(...)``), a backward, the trainer's loss, generation.
MODEL_CALLS = {"forward", "backward", "compute_loss", "generate"}


def runs_the_model(call: ast.Call) -> bool:
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    a_model = name == "model" or (name.endswith("_model") and not name.startswith(("get_", "has_", "is_")))
    return a_model or name in MODEL_CALLS


def model_calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.func)}(...)"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and runs_the_model(node)
    ]


def test_model_calls_are_found_as_written():
    """The check below sees each way a rule could run the model, and not a getter of one."""
    calls = [
        ast.parse(code).body[0].value
        for code in (
            "model(**inputs)",
            "trainer.model(input_ids=ids)",
            "peft_model(x)",
            "loss.backward()",
            "trainer.compute_loss(model, inputs)",
            "model.generate(ids)",
            "model.forward(ids)",
        )
    ]
    assert all(runs_the_model(c) for c in calls)
    getters = [
        ast.parse(c).body[0].value for c in ("model.get_base_model()", "has_peft_model(ctx)", "f(model)")
    ]
    assert not any(runs_the_model(c) for c in getters)


def test_rules_run_no_forward_or_backward():
    """Every extra forward and backward is owned by the measurement layer (hf_sanity/measure/, reached through
    the context's lazy measurements); a rule reads what it measured and judges it."""
    found = [line for path in sorted((PACKAGE / "rules").rglob("*.py")) for line in model_calls(path)]
    assert found == []


def test_rules_read_only_the_public_context():
    """A rule reads what the context offers (``ctx.model``, ``ctx.model_given``, its measurements), never its
    private state: what the context keeps privately it may change."""
    private = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
        for path in sorted((PACKAGE / "rules").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "ctx"
        and node.attr.startswith("_")
    ]
    assert private == []


def test_production_code_does_not_depend_on_the_test_fixtures():
    """hf_sanity.testing builds tiny models and data for tests; what checks a user's setup never needs it. The
    demo is the exception by design: it runs on those fixtures."""
    graph = import_graph()
    users = sorted(
        name
        for name, targets in graph.items()
        if not name.startswith("hf_sanity.testing")
        and any(t.startswith("hf_sanity.testing") for t in targets)
    )
    assert users == ["hf_sanity.demo"]


def test_recipes_use_only_the_public_api():
    """A recipe is what users copy: it imports ``hf_sanity`` (its exports) and the documented tiny fixtures of
    ``hf_sanity.testing``, never a module of the implementation."""
    for recipe in sorted((ROOT / "recipes").glob("*.py")):
        tree = ast.parse(recipe.read_text(encoding="utf-8"))
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        ours = {name for name in imported if name.split(".")[0] == "hf_sanity"}
        assert ours <= {"hf_sanity", "hf_sanity.testing"}, (recipe.name, sorted(ours))


@pytest.mark.slow
def test_the_catalog_and_option_checks_load_without_torch_or_transformers():
    code = (
        "import sys\n"
        "from hf_sanity import catalog\n"
        "from hf_sanity.selection import resolve\n"
        "catalog.load(); resolve('prompt-in-loss', use_config=False)\n"
        "from hf_sanity.cli import main\n"
        "sys.argv = ['hf-sanity', 'preflight', '--model', 'm', '--dataset', 'd', '--select', 'no-such-rule']\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    print(exc.code)\n"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split("\n")[:2] == ["2", "[]"], result.stdout + result.stderr
    assert "unknown rule or stage 'no-such-rule'" in result.stderr


def test_the_cli_stays_thin():
    """cli.py parses, calls a driver and renders: loading and saving live in hf_sanity/drivers (drivers/load.py,
    drivers/commands.py), and no flag is hidden (each is public, in --help)."""
    text = (PACKAGE / "cli.py").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 450, (
        f"hf_sanity/cli.py has {len(text.splitlines())} lines: move logic to drivers/"
    )
    for call in (
        "from_pretrained",
        "load_dataset",
        "save_pretrained",
        "load_model",
        "load_tokenizer",
        ".save(",
    ):
        assert call not in text, f"cli.py calls {call}: loading and saving belong to hf_sanity/drivers"
    options = (PACKAGE / "cli_options.py").read_text(encoding="utf-8")
    assert "hidden=True" not in text + options


def test_the_fix_hint_passes_every_option_fix_takes_at_its_default():
    """The `hf-sanity fix ...` line under a preflight report leaves out the options at fix's own defaults: the
    driver's table of them is the CLI's, option for option."""
    import inspect

    from hf_sanity.cli import fix_command
    from hf_sanity.drivers.commands import FIX_DEFAULTS

    defaults = {name: p.default for name, p in inspect.signature(fix_command).parameters.items()}
    assert {name: defaults[name] for name in FIX_DEFAULTS} == FIX_DEFAULTS


def test_the_callback_stays_a_thin_adapter():
    """SanityCallback translates Trainer events into calls on plain objects of hf_sanity.training; what it
    decides or computes lives there, where it is tested without a Trainer."""
    lines = (PACKAGE / "callback.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, (
        f"hf_sanity/callback.py has {len(lines)} lines: move logic to hf_sanity/training/"
    )


# -- the context is read-only ---------------------------------------------------------------------------
def test_no_rule_writes_to_the_context(tmp_path, conversations):
    """Every context detector runs on one context (a model, a trained adapter, an eval split, an inference
    tokenizer); afterwards nothing it held was replaced, and it only gained its own lazy measurements."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model

    from hf_sanity.measure.context import Context
    from hf_sanity.measure.encode import EncodeOptions
    from hf_sanity.testing import build_tokenizer, tiny_setup

    model, tok = tiny_setup("chatml", "distinct")
    model = copy.deepcopy(model)
    peft = get_peft_model(
        copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_()
    peft.save_pretrained(tmp_path / "adapter")
    ctx = Context(
        tokenizer=tok,
        dataset=datasets.Dataset.from_list(conversations[:24]),
        options=EncodeOptions(fmt="messages", max_len=128),
        model=model,
        eval_dataset=datasets.Dataset.from_list(conversations[24:32]),
        inference_tokenizer=build_tokenizer("llama3"),
        adapter_path=str(tmp_path / "adapter"),
        sample=8,
    )
    ctx.encoded  # noqa: B018
    before = {key: id(value) for key, value in vars(ctx).items()}
    lazy = {name for name, value in vars(Context).items() if hasattr(value, "__set_name__")}
    for detector in catalog.detectors("context"):
        for finding in catalog.run(detector, ctx):
            assert finding.rule != "internal-error", finding.message
        after = vars(ctx)
        assert {k for k in before if id(after.get(k)) != before[k]} == set(), detector.name
        assert set(after) - set(before) <= lazy, detector.name
    assert ctx.model is model and not any("lora" in name for name, _ in model.named_modules())
    with pytest.raises(AttributeError, match="read-only"):
        ctx.model_config = None


# -- extra passes leave no trace --------------------------------------------------------------------------
def test_untouched_restores_every_module_mode_rng_and_grads():
    import torch

    from hf_sanity.untouched import untouched

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 2))
    model.train()
    model[2].eval()  # a submodule the user keeps in eval mode
    model(torch.ones(1, 4)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    with untouched(model):
        assert not any(m.training for m in model.modules())
        model(torch.ones(3, 4))
        torch.rand(5)
    assert [m.training for m in model.modules()] == [True, True, True, False]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert torch.equal(torch.get_rng_state(), rng)


# -- devices: code that creates tensors names the device ------------------------------------------------
FACTORIES = {"eye", "zeros", "ones", "arange", "full", "tensor", "as_tensor", "empty", "randn", "rand",
             "randint", "linspace", "logspace"}  # fmt: skip


def test_every_tensor_factory_names_its_device():
    """A factory call without ``device=`` makes a CPU tensor; beside a model on ``cuda:0`` that is a crash
    (``torch.eye`` in untrained-special-tokens once turned every GPU preflight into internal errors). CI has no
    GPU, so the class of bug is caught here: every factory call passes ``device=`` (``device="cpu"`` where the
    CPU is meant, e.g. pinned host memory)."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and ast.unparse(node.func.value) == "torch"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.{node.func.attr}(...)")
    assert offenders == []


# -- a monitor's `reads` is its contract -------------------------------------------------------------------
PRODUCERS = [PACKAGE / "callback.py", *sorted((PACKAGE / "training").glob("*.py"))]


def _values_reads(func: ast.FunctionDef, problems: list[str], where: str) -> tuple[set[str], set[str]]:
    """(keys ``func`` reads from its ``values`` parameter, names of the functions it passes ``values`` on to).
    Every use of ``values`` must be ``values.get("k")``, ``values["k"]``, ``"k" in values`` or passing it on;
    a key is a string literal or a loop variable over a tuple of them."""
    loops = {  # loop variable -> the literal keys it runs over
        node.target.id: {e.value for e in node.iter.elts}
        for node in ast.walk(func)
        if isinstance(node, ast.For)
        and isinstance(node.target, ast.Name)
        and isinstance(node.iter, ast.Tuple)
        and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts)
    }

    def keys(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name) and node.id in loops:
            return loops[node.id]
        problems.append(
            f"{where}:{node.lineno}: values read with a key that is not a literal: {ast.unparse(node)}"
        )
        return set()

    read: set[str] = set()
    passed: set[str] = set()
    uses = {id(n) for n in ast.walk(func) if isinstance(n, ast.Name) and n.id == "values"}
    understood: set[int] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
            if isinstance(target, ast.Name) and target.id == "values" and node.func.attr == "get":
                read |= keys(node.args[0])
                understood.add(id(target))
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "values":
            read |= keys(node.slice)
            understood.add(id(node.value))
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            right = node.comparators[0]
            if (
                isinstance(right, ast.Name)
                and right.id == "values"
                and isinstance(node.ops[0], (ast.In, ast.NotIn))
            ):
                read |= keys(node.left)
                understood.add(id(right))
        if isinstance(node, ast.Call):
            for arg in node.args:
                if isinstance(arg, ast.Name) and arg.id == "values":
                    passed.add(
                        node.func.attr if isinstance(node.func, ast.Attribute) else ast.unparse(node.func)
                    )
                    understood.add(id(arg))
    for node in ast.walk(func):
        if id(node) in uses - understood and not isinstance(node.ctx, ast.Store):
            problems.append(f"{where}:{node.lineno}: values used other than by its keys")
    return read, passed


def monitor_reads(cls) -> tuple[set[str], list[str]]:
    """Every key the code of monitor ``cls`` reads from ``values``: its methods (its bases' too) and the
    functions of its module it hands ``values`` to."""
    import inspect

    problems: list[str] = []
    functions: dict[str, ast.FunctionDef] = {}
    for klass in reversed(cls.__mro__[:-1]):  # a subclass's method wins
        if not klass.__module__.startswith("hf_sanity"):
            continue
        tree = ast.parse(inspect.getsource(sys.modules[klass.__module__]))
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                functions.setdefault(node.name, node)
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                functions.update({f.name: f for f in node.body if isinstance(f, ast.FunctionDef)})
    read: set[str] = set()
    todo, seen = ["update"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        func = functions[name]
        if "values" not in {a.arg for a in func.args.args + func.args.kwonlyargs}:
            problems.append(f"{cls.__name__}.{name}: is handed values but names the parameter otherwise")
            continue
        keys, passed = _values_reads(func, problems, f"{cls.__name__}.{name}")
        read |= keys
        todo += sorted(passed)
    return read, problems


def produced_keys() -> set[str]:
    """The keys the callback and hf_sanity/training write into dicts: the keys of dict displays, of
    ``x["k"] = ...`` stores and of ``recorder.push(step, "k", value)`` (a superset of the values fed to the
    monitors: a key that is none of these is produced by nothing)."""
    out: set[str] = set()
    for path in PRODUCERS:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Dict):
                written = list(node.keys)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                written = [node.slice]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "push"
            ):
                written = node.args[1:2]
            else:
                continue
            out |= {k.value for k in written if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return out


@pytest.mark.parametrize("cls", catalog.monitors(), ids=lambda cls: cls.__name__)
def test_a_monitor_reads_only_the_keys_it_declares(cls):
    """``reads`` is the whole contract: MonitorSet feeds a monitor only the keys it declares, so a key read but
    not declared would be silently None in a run (GradientMonitor once declared 2 keys and read 7)."""
    read, problems = monitor_reads(cls)
    assert problems == []
    assert read, f"{cls.__name__} reads nothing from values: the check does not see its code"
    assert sorted(read - set(cls.reads)) == [], f"{cls.__name__} reads keys it does not declare"
    assert sorted(set(cls.reads) - read) == [], f"{cls.__name__} declares keys it never reads"


def test_every_key_a_monitor_declares_is_produced_by_a_measurement():
    produced = produced_keys()
    assert {"loss", "grad_norm", "shapes", "graph_tensors", "checksum_max"} <= produced  # the scan works
    unproduced = {
        f"{cls.__name__}.{key}" for cls in catalog.monitors() for key in cls.reads if key not in produced
    }
    assert sorted(unproduced) == []


# -- never the run's -------------------------------------------------------------------------------------
# Where hf-sanity's code runs inside the user's run: every Trainer event of the callbacks, what the instruments
# call on their observer, and the train-begin setup. Each is a row of guarded blocks.
GUARDED = {
    (PACKAGE / "callback.py", "SanityCallback"): (
        "before_micro", "after_micro", "grad_norm", "pre_forward", "post_forward", "failed", "state",
    ),
    (PACKAGE / "launch" / "hook.py", "HfSanityLaunch"): ("export",),
    (PACKAGE / "training" / "begin.py", None): ("watch",),
}  # fmt: skip


def _is_guard(item: ast.withitem) -> bool:
    """``with <sink>.guard(...)``, the launcher's ``with unbreakable(...)``, ``with contextlib.suppress(Exception)``."""
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
    if name == "suppress":
        return any(isinstance(a, ast.Name) and a.id == "Exception" for a in call.args)
    return name in ("guard", "unbreakable")


def _unguarded(statements: list[ast.stmt], where: str) -> list[str]:
    """The statements of a body that run outside a guard. Allowed bare: a docstring, ``return`` of a name, a
    constant or another event of a callback (itself checked), ``pass``, a local name bound to what calls
    nothing, an ``if`` that calls nothing in its test, and ``try``/``finally`` around guarded blocks."""
    out = []
    for stmt in statements:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Return):
            value = stmt.value
            delegated = (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr.startswith("on_")
            )
            if value is None or isinstance(value, (ast.Name, ast.Constant)) or delegated:
                continue
        if isinstance(stmt, ast.With) and _is_guard(stmt.items[0]):
            continue
        if (
            isinstance(stmt, ast.Assign)
            and all(isinstance(t, ast.Name) for t in stmt.targets)
            and not any(isinstance(n, ast.Call) for n in ast.walk(stmt.value))
        ):
            continue  # a local name for what is at hand
        if isinstance(stmt, ast.If) and not any(isinstance(n, ast.Call) for n in ast.walk(stmt.test)):
            out += _unguarded(stmt.body, where) + _unguarded(stmt.orelse, where)
            continue
        if isinstance(stmt, ast.Try) and not stmt.handlers:
            out += _unguarded(stmt.body, where) + _unguarded(stmt.finalbody, where)
            continue
        out.append(f"{where}:{stmt.lineno}: {ast.unparse(stmt).splitlines()[0]}")
    return out


def _guarded_functions() -> list[tuple[str, ast.FunctionDef]]:
    out = []
    for (path, klass), extra in GUARDED.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scopes = (
            [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == klass] if klass else [tree]
        )
        assert scopes, f"{path.name} has no class {klass}"
        functions = [n for n in scopes[0].body if isinstance(n, ast.FunctionDef)]
        chosen = [f for f in functions if f.name.startswith("on_") or f.name in extra]
        assert {f.name for f in chosen} >= set(extra), f"{path.name}: {set(extra) - {f.name for f in chosen}}"
        out += [(f"{path.relative_to(ROOT)}:{klass or ''}.{f.name}", f) for f in chosen]
    return out


def test_every_event_of_the_callbacks_runs_each_part_in_its_own_guard():
    """Never the run's: no statement of a Trainer event, of what the instruments call, or of the train-begin
    setup runs outside a guard, so one broken measurement is one internal-error finding that skips only itself
    (a guard around a whole event would leave the rest of it blind)."""
    functions = _guarded_functions()
    events = {name.rsplit(".", 1)[1] for name, _ in functions}
    assert {
        "on_train_begin",
        "on_step_end",
        "on_train_end",
        "on_log",
        "on_init_end",
    } <= events  # the scan works
    problems = [line for name, func in functions for line in _unguarded(func.body, name)]
    assert problems == []


def test_the_instruments_call_only_guarded_observer_methods():
    """The wrapped training step, the forward hooks and the norm wrapper reach hf-sanity's code only through the
    observer's methods checked above; the user's exception is re-raised as it came."""
    checked = set(GUARDED[(PACKAGE / "callback.py", "SanityCallback")])
    tree = ast.parse((PACKAGE / "training" / "instrument.py").read_text(encoding="utf-8"))
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "observer"
    }
    assert {"before_micro", "failed"} <= called  # the scan works
    assert sorted(called - checked) == []
    handlers = [n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler)]
    for handler in handlers:  # an except that catches the user's exception ends by re-raising it, unchanged
        if ast.unparse(handler.type or ast.Name("BaseException")) == "BaseException":
            assert isinstance(handler.body[-1], ast.Raise) and handler.body[-1].exc is None


# -- the measurement plan --------------------------------------------------------------------------------
def _slug_constants(module) -> dict[str, str]:
    """A module's upper-case string constants (``COLLAPSE_RULE = "expert-collapse"``)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, str) and k.isupper()}


def test_no_planner_decides_by_rule_names_where_a_step_detector_declares_its_reads():
    """What the callback measures follows the enabled step detectors' ``reads`` (``sink.measures(*keys)``), not
    a list of slugs: a list misses the rule that reads a value too (the update ratio once was sampled only for
    loss-flat and lr-too-low, and loss-diverged lost its cause ``lr-too-high``)."""
    import importlib

    rules = catalog.load()
    stepped = {slug for slug, rule in rules.items() if any(d.kind == "step" for d in rule.detectors)}
    paths = [PACKAGE / "callback.py", *sorted((PACKAGE / "training").glob("*.py"))]
    problems, seen = [], 0
    for path in paths:
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        constants = _slug_constants(module)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name not in ("wants", "enabled"):
                continue
            seen += 1
            for arg in node.args:
                slug = arg.value if isinstance(arg, ast.Constant) else None
                if isinstance(arg, ast.Name):
                    slug = constants.get(arg.id)
                if slug in stepped:
                    problems.append(
                        f"{path.relative_to(ROOT)}:{node.lineno}: {name}({slug!r}): use measures(<reads>)"
                    )
    assert seen >= 2  # the scan works: the first batch's token rules are asked for by name (context rules)
    assert problems == []


def test_the_plan_measures_what_the_rules_that_name_a_cause_read():
    """select=["loss-diverged"] (or grad-explosion) alone still samples the update ratio behind ``lr-too-high``."""
    from hf_sanity.selection import Selection
    from hf_sanity.training.sink import FindingSink

    for slug in ("loss-diverged", "grad-explosion", "loss-flat"):
        sink = FindingSink(Selection(select=frozenset({slug})))
        assert sink.measures("update_ratio"), slug
    assert not FindingSink(Selection(select=frozenset({"oom"}))).measures("update_ratio")
