"""CPU tests of the command line: `moegen build` succeeds with one line per spec, and every user
mistake is one `moegen: error:` line on stderr, a non-zero status, no traceback, no files written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import moegen
import moegen.build as build_mod
import moegen.uptodate as up
from moegen.cli import main
from moegen.render import CUDA_FILE

ROOT = Path(__file__).resolve().parent.parent
QWEN = ROOT / "specs" / "qwen3-30b-a3b.yaml"
OLMOE = ROOT / "specs" / "olmoe-1b-7b.yaml"
PKG_PARENT = str(Path(moegen.__file__).resolve().parent.parent)
PREFIX = "moegen: error:"


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def cache(module_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """One cubin cache for this module's tests (each spec compiles once); never ~/.cache."""
    monkeypatch.setenv("MOEGEN_CACHE", str(module_cache))
    return module_cache


@pytest.fixture
def site_nvrtc():
    """NVRTC as a fresh `moegen build` loads it, from site-packages; skips where this process loaded
    it through another library first (PyTorch, imported by an earlier test, loads the same
    libnvrtc): cuda.pathfinder then reports it as loaded elsewhere, and a build keeps no stamp, by
    design (moegen.uptodate.inputs_now)."""
    from cuda import pathfinder

    lib = pathfinder.load_nvidia_dynamic_lib("nvrtc")
    if lib.found_via != "site-packages":
        pytest.skip(f"NVRTC in this process was found via {lib.found_via!r}, not site-packages: no stamps")
    return lib


def one_error(err: str) -> str:
    """The error line; fails unless stderr holds exactly one `moegen: error:` line, first, and no traceback."""
    lines = err.splitlines()
    assert lines and lines[0].startswith(PREFIX), f"stderr does not start with {PREFIX!r}:\n{err}"
    assert sum(line.startswith(PREFIX) for line in lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def files_under(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


def test_build_prints_one_line_per_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    assert main(["build", str(QWEN), str(OLMOE), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 2, captured.out
    for line, name in zip(lines, ["qwen3-30b-a3b", "olmoe-1b-7b"]):
        assert line.startswith(f"{name}: ") and "kernels" in line and "0 spill bytes" in line
        assert str(out / name) in line
    assert captured.err == ""
    assert sorted(p.name for p in out.iterdir()) == ["olmoe-1b-7b", "qwen3-30b-a3b"]


def test_arch_sm90a_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["build", str(QWEN), "--arch", "sm_90a", "--out", str(tmp_path)]) == 0
    assert "sm_90a" in capsys.readouterr().out
    assert (tmp_path / "qwen3-30b-a3b" / CUDA_FILE).is_file()


def test_second_build_reports_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str], site_nvrtc):
    main(["build", str(QWEN), "--out", str(tmp_path)])
    capsys.readouterr()
    assert main(["build", str(QWEN), "--out", str(tmp_path)]) == 0
    assert ", up to date in " in capsys.readouterr().out
    launcher = tmp_path / "qwen3-30b-a3b" / "launcher.py"
    written = launcher.read_text()
    launcher.write_text(written + "# edited\n")  # an output changed: the build runs, from the cubin cache
    assert main(["build", str(QWEN), "--out", str(tmp_path)]) == 0
    assert ", cached in " in capsys.readouterr().out
    assert launcher.read_text() == written
    assert main(["build", str(QWEN), "--out", str(tmp_path), "--no-cache"]) == 0
    assert ", compiled in " in capsys.readouterr().out


def _up_to_date(spec: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> bool:
    assert main(["build", str(spec), "--out", str(out)]) == 0
    line = capsys.readouterr().out
    assert line.startswith(f"{spec.stem}: ") and line.endswith(f"-> {out / spec.stem}\n"), line
    return ", up to date in " in line


def test_a_build_is_up_to_date_only_while_its_inputs_and_outputs_are_unchanged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], site_nvrtc):
    spec, out = tmp_path / "olmoe-1b-7b.yaml", tmp_path / "gen"
    spec.write_text(OLMOE.read_text())
    assert not _up_to_date(spec, out, capsys)
    assert _up_to_date(spec, out, capsys)
    spec.write_text(OLMOE.read_text() + "max_tokens: 128\n")  # another plan
    assert not _up_to_date(spec, out, capsys)
    assert "N <= 128" in (out / "olmoe-1b-7b" / "launcher.py").read_text()
    assert _up_to_date(spec, out, capsys)
    (out / "olmoe-1b-7b" / "stray.txt").write_text("x")  # an output directory not as written
    assert not _up_to_date(spec, out, capsys)
    assert not (out / "olmoe-1b-7b" / "stray.txt").exists()
    assert _up_to_date(spec, out, capsys)
    (out / "olmoe-1b-7b.tuning.json").write_text('{"warps": 8, "down_tiles": 1}')  # a tuning file appears
    assert not _up_to_date(spec, out, capsys)
    assert _up_to_date(spec, out, capsys)
    for key in json.loads(up._stamp_path(spec, out, None).read_text())["cubins"]:  # a corrupt cubin: compiled again
        (Path(os.environ["MOEGEN_CACHE"]) / key / "layer.cubin").write_bytes(b"corrupt")
    assert not _up_to_date(spec, out, capsys)
    assert _up_to_date(spec, out, capsys)
    templates = tmp_path / "templates"  # moegen's own code changed (a template)
    templates.mkdir()
    for t in up.template_dir().glob("*.j2"):
        (templates / t.name).write_text(t.read_text() + ("// changed\n" if t.name == "route.cu.j2" else ""))
    monkeypatch.setattr(up, "template_dir", lambda: templates)
    assert not _up_to_date(spec, out, capsys)


def test_no_stamp_where_nvrtc_is_not_the_site_packages_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str], site_nvrtc):
    from types import SimpleNamespace

    from cuda import pathfinder

    real = site_nvrtc
    assert _up_to_date(OLMOE, tmp_path, capsys) is False
    assert _up_to_date(OLMOE, tmp_path, capsys) is True
    # found elsewhere (a system CUDA, which another NVRTC installed later would go ahead of): no stamp
    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib",
                        lambda name: SimpleNamespace(abs_path=real.abs_path, found_via="system-search"))
    (tmp_path / "olmoe-1b-7b" / "launcher.py").write_text("# edited\n")
    assert _up_to_date(OLMOE, tmp_path, capsys) is False
    assert not up._stamp_path(OLMOE, tmp_path, None).exists()
    assert _up_to_date(OLMOE, tmp_path, capsys) is False


def test_an_up_to_date_build_imports_none_of_the_compiler(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": PKG_PARENT}
    code = ("import sys\nfrom moegen.cli import main\nmain(['build', sys.argv[1], '--out', sys.argv[2]])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'jinja2', 'numpy', 'yaml', 'filelock'}"
            " | {m for m in sys.modules if m.startswith('cuda.bindings')}))")
    for expect in ("compiled in ", "up to date in "):
        r = subprocess.run([sys.executable, "-c", code, str(OLMOE), str(tmp_path)], env=env, capture_output=True,
                           text=True, check=True)
        line, imported = r.stdout.splitlines()
        assert expect in line or (expect == "compiled in " and "cached in " in line), line
    assert imported == "[]", imported


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


BAD_KEY = """\
name: t
model: test/model
hidden_size: 2048
experts:
  count: 8
  top_k: 2
  intermediate_size: 1024
  bogus_key: 1
"""


def case_missing_spec(tmp_path: Path) -> tuple[list[str], list[str]]:
    p = tmp_path / "no-such.yaml"
    return [str(p)], [str(p), "no such spec file"]


def case_spec_is_a_directory(tmp_path: Path) -> tuple[list[str], list[str]]:
    d = tmp_path / "adir.yaml"
    d.mkdir()
    return [str(d)], [str(d)]


def case_unknown_key(tmp_path: Path) -> tuple[list[str], list[str]]:
    p = write(tmp_path, "bad.yaml", BAD_KEY)
    return [str(p)], [f"{p}:8", "experts.bogus_key", "unknown key"]


def case_not_yaml(tmp_path: Path) -> tuple[list[str], list[str]]:
    p = write(tmp_path, "bad.yaml", "name: [unclosed\n")
    return [str(p)], [str(p), "not valid YAML"]


def case_unsupported_arch(tmp_path: Path) -> tuple[list[str], list[str]]:
    return [str(QWEN), "--arch", "sm_80"], ["arch", "sm_80", "sm_90a"]


def case_out_under_a_file(tmp_path: Path) -> tuple[list[str], list[str]]:
    f = write(tmp_path, "file", "x\n")
    return [str(QWEN), "--out", str(f / "sub")], [str(f / "sub"), "not a directory"]


def case_out_is_a_file(tmp_path: Path) -> tuple[list[str], list[str]]:
    f = write(tmp_path, "file", "x\n")
    return [str(QWEN), "--out", str(f)], [str(f), "not a directory"]


def case_plan_refuses(tmp_path: Path) -> tuple[list[str], list[str]]:
    p = write(tmp_path, "odd.yaml", BAD_KEY.replace("  bogus_key: 1\n", "").replace("2048", "2050"))
    return [str(p)], [str(p), "hidden_size=2050"]


def case_unusable_cache(tmp_path: Path) -> tuple[list[str], list[str]]:
    f = write(tmp_path, "file", "x\n")
    os.environ["MOEGEN_CACHE"] = str(f / "cache")  # restored by monkeypatch (the autouse fixture set it)
    return [str(QWEN), "--out", str(tmp_path / "out")], [str(f / "cache"), "cubin cache", "--no-cache"]


CASES = [case_missing_spec, case_spec_is_a_directory, case_unknown_key, case_not_yaml, case_unsupported_arch,
         case_out_under_a_file, case_out_is_a_file, case_plan_refuses, case_unusable_cache]


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__.removeprefix("case_"))
def test_user_errors_are_one_line(case, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    args, wanted = case(tmp_path)
    before = files_under(tmp_path)
    assert main(["build", *args, *([] if "--out" in args else ["--out", str(tmp_path / "out")])]) != 0
    captured = capsys.readouterr()
    line = one_error(captured.err)
    assert len(captured.err.splitlines()) == 1, f"expected one line:\n{captured.err}"
    missing = [w for w in wanted if w not in line]
    assert not missing, f"{line!r} does not say {missing}"
    assert captured.out == ""
    assert files_under(tmp_path) == before, "a failed build wrote files"


def test_compile_error_is_one_line_then_the_details(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    assert main(["build", str(QWEN), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in (out / "qwen3-30b-a3b").iterdir()}
    capsys.readouterr()
    real = build_mod.render_all

    def broken(spec, plan):
        files = real(spec, plan)
        files[CUDA_FILE] = files[CUDA_FILE].replace('extern "C"', "int planted_error = ;\nextern \"C\"", 1)
        return files

    monkeypatch.setattr(build_mod, "render_all", broken)
    monkeypatch.setattr(up, "check", lambda *a: None)  # (moegen's code changed: the stamp would see it)
    assert main(["build", str(QWEN), "--out", str(out)]) != 0
    err = capsys.readouterr().err
    line = one_error(err)
    assert line.startswith(f"{PREFIX} {out / 'qwen3-30b-a3b' / CUDA_FILE}:") and ": error: " in line, line
    assert all(x.startswith(" ") or not x for x in err.splitlines()[1:]), "details are indented under the line"
    assert "full log:" in err
    assert {p.name: p.read_bytes() for p in (out / "qwen3-30b-a3b").iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["qwen3-30b-a3b"], "temporary directories left behind"


def run_moegen(*args: str, cache: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MOEGEN_CACHE": str(cache), "PYTHONPATH": PKG_PARENT}
    return subprocess.run([sys.executable, "-m", "moegen", *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def test_python_m_moegen_build(tmp_path: Path, cache: Path):
    r = run_moegen("build", str(QWEN), "--out", str(tmp_path / "out"), cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("qwen3-30b-a3b: ") and len(r.stdout.splitlines()) == 1, r.stdout
    assert (tmp_path / "out" / "qwen3-30b-a3b" / "manifest.json").is_file()


def test_python_m_moegen_error(tmp_path: Path, cache: Path):
    r = run_moegen("build", "no/such/spec.yaml", cache=cache, cwd=tmp_path)
    assert r.returncode == 1
    assert one_error(r.stderr) == f"{PREFIX} no/such/spec.yaml: no such spec file"
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_version(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out.strip() == f"moegen {moegen.__version__}"


@pytest.mark.parametrize("cmd, extra, why", [
    ("bench", [], "bench times the layer on a GPU: no GPU in this test"),
    ("bench", ["--ep-size", "2"], "bench times the layer on a GPU: no GPU in this test"),
    ("tune", ["--write"], "tune times the layer's variants on a GPU: no GPU in this test"),
])
def test_gpu_commands_without_a_gpu_are_one_line(cmd, extra, why, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], tmp_path: Path):
    monkeypatch.setattr("moegen.check.gpu_unavailable_reason", lambda: "no GPU in this test")
    assert main([cmd, str(ROOT / "specs" / "qwen3-30b-a3b.yaml"), *extra, "--out", str(tmp_path)]) == 1
    assert not any(tmp_path.iterdir()), "nothing is written"
    err = capsys.readouterr().err
    assert err == f"moegen: error: {why}\n"


@pytest.mark.parametrize("cmd, extra, why", [
    ("bench", ["--tokens", "1,x"], "bench --tokens 1,x: 'x' is not a token count (comma-separated integers >= 1)"),
    ("tune", ["--tokens", "8,0"], "tune --tokens 8,0: '0' is not a token count (comma-separated integers >= 1)"),
    ("tune", ["--only", "warps,bogus"], "tune --only warps,bogus: choices are "),
])
def test_gpu_commands_name_a_wrong_argument_before_looking_for_a_gpu(cmd, extra, why, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str], tmp_path: Path):
    """A wrong --tokens or --only is named as such (one line, nothing written), GPU or not: the
    arguments are checked before the device."""
    monkeypatch.setattr("moegen.check.gpu_unavailable_reason", lambda: "no GPU in this test")
    assert main([cmd, str(ROOT / "specs" / "qwen3-30b-a3b.yaml"), *extra, "--out", str(tmp_path)]) == 1
    assert not any(tmp_path.iterdir()), "nothing is written"
    err = capsys.readouterr().err
    assert err.startswith(f"moegen: error: {why}") and err.count("\n") == 1, err
