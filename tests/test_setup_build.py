"""The choice of build (setup.py and its backend, build_backend/stallfree_build.py): a regular install
compiles where it can and is pure Python otherwise, an editable one is always pure Python and fetches nothing
for compiling, and STALLFREE_COMPILE overrides (1: compile or fail, 0: never).

The build itself (mypyc, then the C compiler) is exercised by CI's compiled install; these check the choice
made before it: the requirements each hook asks pip for, and setup.py's answer to each command line
setuptools' backend runs it with.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup_py() -> ModuleType:
    return _load("stallfree_setup_under_test", ROOT / "setup.py")  # not __main__: setup() is not called


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The backend, setuptools' own requirements stubbed (their hooks run setup.py in the working directory)."""
    module = _load("stallfree_build_under_test", ROOT / "build_backend" / "stallfree_build.py")
    monkeypatch.setattr(module._setuptools, "get_requires_for_build_wheel", lambda config_settings=None: ["wheel"])
    monkeypatch.setattr(module._setuptools, "get_requires_for_build_editable", lambda config_settings=None: [])
    return module


@pytest.mark.parametrize(("value", "mode"), [(None, "auto"), ("", "auto"), ("auto", "auto"), (" AUTO ", "auto"),
                                             ("0", "0"), ("1", "1")])
def test_the_mode_read_from_the_environment(backend: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                            value: str | None, mode: str) -> None:
    if value is None:
        monkeypatch.delenv("STALLFREE_COMPILE", raising=False)
    else:
        monkeypatch.setenv("STALLFREE_COMPILE", value)
    assert backend.compile_mode() == mode


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_an_unknown_mode_is_refused_naming_it(backend: ModuleType, setup_py: ModuleType,
                                              monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """Refused by the first hook pip calls, before anything is fetched, and by setup.py itself."""
    monkeypatch.setenv("STALLFREE_COMPILE", value)
    for call in (backend.get_requires_for_build_wheel, backend.get_requires_for_build_editable,
                 lambda: setup_py.native_build(["setup.py", "bdist_wheel"])):
        with pytest.raises(SystemExit, match=rf"STALLFREE_COMPILE='{value}': use 1 .* 0 .* or auto"):
            call()


@pytest.mark.parametrize(("mode", "wheel"), [("", ["wheel", "mypy>=1.15", "numpy>=1.26"]),
                                             ("1", ["wheel", "mypy>=1.15", "numpy>=1.26"]), ("0", ["wheel"])])
def test_a_regular_build_asks_for_mypy_and_numpy_unless_it_never_compiles(
        backend: ModuleType, monkeypatch: pytest.MonkeyPatch, mode: str, wheel: list[str]) -> None:
    monkeypatch.setenv("STALLFREE_COMPILE", mode)
    assert backend.get_requires_for_build_wheel() == wheel


@pytest.mark.parametrize("mode", ["", "auto", "0"])
def test_an_editable_build_asks_for_nothing_more(backend: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                 mode: str) -> None:
    monkeypatch.setenv("STALLFREE_COMPILE", mode)
    assert backend.get_requires_for_build_editable() == []


def test_the_metadata_passes_and_mode_0_build_nothing(setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALLFREE_COMPILE", raising=False)
    assert setup_py.native_build(["setup.py", "egg_info"]) == {}
    assert setup_py.native_build(["setup.py", "dist_info", "--output-dir", "x"]) == {}
    monkeypatch.setenv("STALLFREE_COMPILE", "0")
    assert setup_py.native_build(["setup.py", "bdist_wheel"]) == {}


def test_an_editable_install_is_pure_python_and_refused_when_compiling_is_required(
        backend: ModuleType, setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused by the backend's first hook, before mypy is fetched, and by setup.py if run directly."""
    monkeypatch.delenv("STALLFREE_COMPILE", raising=False)
    assert setup_py.native_build(["setup.py", "editable_wheel", "--dist-dir", "x"]) == {}
    monkeypatch.setenv("STALLFREE_COMPILE", "1")
    with pytest.raises(SystemExit, match="needs a regular install"):
        backend.get_requires_for_build_editable()
    with pytest.raises(SystemExit, match="needs a regular install"):
        setup_py.native_build(["setup.py", "editable_wheel", "--dist-dir", "x"])


def test_without_a_compiler_the_install_goes_on_pure_python_saying_why(
        setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """$CC, which setuptools compiles with, names no program: auto says so on stderr and builds no extension;
    STALLFREE_COMPILE=1 fails the install with the same reason."""
    monkeypatch.setenv("CC", "/nonexistent/cc -O2")
    monkeypatch.delenv("STALLFREE_COMPILE", raising=False)
    assert setup_py.native_build(["setup.py", "bdist_wheel"]) == {}
    err = capsys.readouterr().err
    assert "installing the pure-Python build: no C compiler (/nonexistent/cc, named by $CC, is not found" in err
    monkeypatch.setenv("STALLFREE_COMPILE", "1")
    with pytest.raises(SystemExit, match=r"STALLFREE_COMPILE=1: no C compiler \(/nonexistent/cc, named by \$CC"):
        setup_py.native_build(["setup.py", "bdist_wheel"])


def test_without_python_headers_the_install_goes_on_pure_python(
        setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    monkeypatch.delenv("STALLFREE_COMPILE", raising=False)
    monkeypatch.setattr(setup_py.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert setup_py.native_build(["setup.py", "bdist_wheel"]) == {}
    assert f"Python's headers are missing (no Python.h under {tmp_path}" in capsys.readouterr().err


def test_without_mypy_the_install_goes_on_pure_python_unless_compiling_is_required(
        setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """pip install --no-build-isolation into an environment without mypy."""
    monkeypatch.delenv("STALLFREE_COMPILE", raising=False)
    monkeypatch.setattr(setup_py, "_why_not_compiler", lambda: None)
    monkeypatch.setitem(sys.modules, "mypyc.build", None)  # import fails
    assert setup_py.native_build(["setup.py", "bdist_wheel"]) == {}
    assert "mypy is not installed in the build's environment" in capsys.readouterr().err
    monkeypatch.setenv("STALLFREE_COMPILE", "1")
    with pytest.raises(SystemExit, match="STALLFREE_COMPILE=1: mypy is not installed"):
        setup_py.native_build(["setup.py", "bdist_wheel"])


def test_a_regular_install_compiles_the_native_modules_where_it_can(
        setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a compiler (checked, not run) and mypyc importable, the build pass hands setuptools mypycify's
    extensions and the build_ext that falls back to pure Python if compiling them fails."""
    monkeypatch.delenv("STALLFREE_COMPILE", raising=False)
    monkeypatch.setattr(setup_py, "_why_not_compiler", lambda: None)
    made: list[list[str]] = []
    fake = ModuleType("mypyc.build")
    fake.mypycify = lambda paths, opt_level: made.append(paths) or ["ext"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mypyc.build", fake)
    got = setup_py.native_build(["setup.py", "bdist_wheel"])
    assert made == [list(setup_py.NATIVE_MODULES)]
    assert got["ext_modules"] == ["ext"]
    assert got["cmdclass"]["build_ext"].__name__ == "FallbackBuildExt"


def test_a_failed_compilation_leaves_no_extension_and_says_why(
        setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    """The fallback build_ext, its compiler a program that always fails (`false`): the build goes on with
    no extension left behind (an extension half built would import a missing shared library)."""
    from setuptools import Distribution, Extension

    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 1; }\n")
    monkeypatch.setenv("CC", "false")
    monkeypatch.chdir(tmp_path)
    dist = Distribution({"name": "probe", "ext_modules": [Extension("probe_ext", [source.name])]})
    cmd = setup_py._fallback_build_ext()(dist)
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "temp")
    cmd.ensure_finalized()
    cmd.run()
    assert "installing the pure-Python build: compiling failed (CompileError" in capsys.readouterr().err
    assert cmd.extensions == []
    assert not list(tmp_path.rglob("probe_ext*"))
