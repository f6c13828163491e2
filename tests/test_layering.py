"""The package boundaries, enforced: rollout/, trainer/ and weight_sync/ never import each other, rlloop or Ray
(nor does weight_sync import torch or jax).

They exchange plain data (token ids, numpy arrays keyed by HF names, small dataclasses), so each can be read,
tested and replaced alone (docs/design.md §2). Every import statement is checked, lazy ones inside functions too.
Inside each package no module imports, even lazily, one that imports it back. Also what the driver and a JAX
engine's process load as they start: every run and every restart waits for it.
"""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("rollout", "trainer", "weight_sync")
# Moving bytes needs no framework: weight_sync takes numpy arrays from whichever side gives them.
ALSO_FORBIDDEN = {"weight_sync": {"torch", "jax"}}


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in a file; relative imports resolve inside its own package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, path.relative_to(root).parts[0] if node.level else node.module.split(".")[0]))
    return out


def violations(package: str, root: Path = ROOT) -> list[str]:
    forbidden = ({"rlloop", "ray", *COMPONENTS} - {package}) | ALSO_FORBIDDEN.get(package, set())
    return [
        f"{path.relative_to(root)}:{line} imports {module}"
        for path in sorted((root / package).rglob("*.py"))
        for line, module in imported_modules(path, root)
        if module in forbidden
    ]


@pytest.mark.parametrize("package", COMPONENTS)
def test_component_imports_no_other_component_nor_rlloop_nor_ray(package):
    assert violations(package) == []


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    """A check that could never fail would prove nothing: plant each kind of import and see it reported."""
    fake = tmp_path / "rollout"
    fake.mkdir()
    (fake / "a.py").write_text("import os\n\ndef f():\n    from trainer import Trainer\n    import ray.util\n")
    (fake / "b.py").write_text("from . import a\nfrom rlloop.config import Config\n")
    assert violations("rollout", tmp_path) == [
        "rollout/a.py:4 imports trainer",
        "rollout/a.py:5 imports ray",
        "rollout/b.py:2 imports rlloop",
    ]


def import_graph(package: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Which of `package`'s modules each of its modules imports: every import, lazy ones too, but not those under
    `if TYPE_CHECKING:` (annotations only, never run)."""
    modules = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for path in sorted((root / package).rglob("*.py"))
    }
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
            for inner in ast.walk(node)
        }
        imported = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                imported |= submodules or {node.module}  # `from rollout import cost` is rollout.cost's import
        graph[name] = (imported & modules.keys()) - {name}
    return graph


@pytest.mark.parametrize("package", ("rlloop", *COMPONENTS))
def test_no_module_imports_one_that_imports_it_back(package):
    """A cycle forces a lazy import with a comment saying why, and hides which module builds on which."""
    graphlib.TopologicalSorter(import_graph(package)).prepare()  # CycleError names the modules of a cycle


def test_the_cycle_check_sees_lazy_cycles_and_not_annotations(tmp_path):
    fake = tmp_path / "rlloop"
    fake.mkdir()
    (fake / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlloop.b import B\n")
    (fake / "b.py").write_text("import rlloop.a\n")
    assert import_graph("rlloop", tmp_path) == {"rlloop.a": set(), "rlloop.b": {"rlloop.a"}}
    (fake / "c.py").write_text("from rlloop import b\n\ndef f():\n    from rlloop.c import x\n")
    (fake / "a.py").write_text("def f():\n    from rlloop import c\n")
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(import_graph("rlloop", tmp_path)).prepare()


def test_the_driver_checks_a_run_without_importing_jax():
    """Where the engine runs in a Ray actor, the driver never needs JAX: its preflight (config, memory plan, reward
    references) must not pay JAX's import, which every `python -m rlloop.run` and every restart would."""
    import subprocess
    import sys

    code = (
        "import sys; from rlloop.config import load_config; from rlloop.preflight import check_before_start; "
        "check_before_start(load_config('examples/grpo_dapo_tiny.yaml')); "
        "print(sorted({'jax', 'jaxlib'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def modules_loaded_by(code: str, watched: set[str]) -> list[str]:
    """Which of `watched` a fresh interpreter has imported after running `code` in the repository root."""
    import subprocess
    import sys

    code += f"; import sys; print(' '.join(sorted(set({sorted(watched)!r}) & set(sys.modules))))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()[-1].split()


def test_the_driver_loads_no_trainer_stack_and_a_jax_engine_no_torch():
    """Every run and every restart pays what its driver and its engine actors import, on one core each: the driver's
    own modules (the loop, the errors it catches, the shm sweep) need neither torch nor ml_dtypes (~6 s together on
    a 2-core host), and a JAX engine's process never loads torch."""
    driver = (
        "import rlloop.run; from rlloop.loop import train; from trainer import NonFiniteTraining; "
        "from rlloop.errors import CheckpointError; from weight_sync.shm import remove_stale_segments"
    )
    assert modules_loaded_by(driver, {"torch", "ml_dtypes", "jax"}) == []
    engine = (
        "from rlloop.config import load_config; from rlloop.workers import RolloutWorker; "
        "from weight_sync import SyncConfig; cfg = load_config('examples/grpo_dapo_tiny.yaml'); "
        "sync = SyncConfig(run_id='layering', transport='disk', delta=False, dir='/nonexistent'); "
        "RolloutWorker(cfg.engine_config(), 'jax', sync)"
    )
    assert modules_loaded_by(engine, {"torch", "jax"}) == ["jax"]
