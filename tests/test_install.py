"""The product as users install it: a wheel built from this checkout, installed (not editable) into a
throwaway environment and run from a folder outside the checkout.

The environment reuses the test environment's third-party packages through a `.pth` path line (a
plain path: the editable install's own import hooks in that folder are not run), so only `attnres`
and `modeling_attnres` come from the wheel, and every check below fails if the code finds a file
through the checkout's layout or the wheel leaves a run-time file out.
"""

import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support.processes import run_bounded

REPO = Path(__file__).resolve().parents[1]
RUNTIME_FOLDERS = {"modeling_attnres": "modeling_attnres", "conversion": "attnres/conversion",
                   "serving": "attnres/serving", "models": "attnres/models"}


class Installed:
    """A throwaway environment with the wheel installed; `run` runs Python code in it from `cwd`."""

    def __init__(self, root: Path, wheel: Path):
        self.root, self.wheel = root, wheel
        self.python = root / "env" / "bin" / "python"
        self.cwd = root / "elsewhere"
        self.cwd.mkdir(exist_ok=True)

    def run(self, code: str, env: dict[str, str] | None = None, timeout: float = 600) -> dict:
        """Run `code` (which prints one JSON line last) in the environment; returns that JSON."""
        done = run_bounded([str(self.python), "-c", code], timeout=timeout, cwd=self.cwd,
                           env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **(env or {})})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


def checkout_files(*folders: str) -> list[str]:
    """The files a clean clone of this checkout holds (committed, or new and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *folders], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True).stdout.split()
    return [p for p in listed if (REPO / p).is_file()]


def tracked_runtime_files() -> list[str]:
    """The checkout's files that the package needs at run time, as paths inside the wheel."""
    return [RUNTIME_FOLDERS[p.split("/", 1)[0]] + "/" + p.split("/", 1)[1] for p in checkout_files(*RUNTIME_FOLDERS)]


def clean_copy(dest: Path) -> Path:
    """The checkout's files copied to `dest`, without build leftovers (a stale `build/` would hide a
    file the package configuration leaves out)."""
    for name in checkout_files():
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("install")
    source = clean_copy(root / "source")
    built = run_bounded([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                         "--wheel-dir", str(root / "dist"), str(source)], timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (root / "dist").glob("attnres-*.whl")
    made = run_bounded([sys._base_executable, "-m", "venv", "--without-pip", str(root / "env")], timeout=120)
    assert made.returncode == 0, made.stderr
    env_site = Path(sysconfig.get_path("purelib", vars={"base": str(root / "env")}))
    (env_site / "test-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    done = run_bounded([sys.executable, "-m", "pip", "--python", str(root / "env" / "bin" / "python"), "install",
                        "--no-deps", "--no-index", "--quiet", str(wheel)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return Installed(root, wheel)


def test_the_wheel_holds_every_runtime_file(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    missing = [f for f in tracked_runtime_files() if f not in names]
    assert not missing, f"the wheel lacks run-time files: {missing}"
    assert not [n for n in names if n.split("/")[0] in ("conversion", "serving", "models", "tests")], \
        "generic top-level names in the wheel"
    with zipfile.ZipFile(installed.wheel) as wheel:                  # the license the metadata declares ships
        metadata = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert wheel.read(license_file) == (REPO / "LICENSE").read_bytes()
    assert "License-Expression: Apache-2.0" in metadata and "Apache License" in (REPO / "LICENSE").read_text()


def test_the_installed_package_runs_from_its_own_files(installed):
    got = installed.run("""
import importlib.metadata, json, attnres.serving, attnres.conversion, attnres.models, modeling_attnres
from attnres.models import depth_parameters_path, shipped_model_path
plugin = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "attnres"]
print(json.dumps({"files": [m.__file__ for m in (attnres.serving, attnres.conversion, attnres.models,
                                                 modeling_attnres)],
                  "resources": [str(shipped_model_path()), str(depth_parameters_path())],
                  "plugin": [e.value for e in plugin], "plugin_file": plugin[0].load().__module__}))
""")
    env = str(installed.root / "env")
    assert all(path.startswith(env) for path in got["files"] + got["resources"]), got
    assert got["plugin"] == ["attnres.serving.plugin:register"], got


def test_the_default_is_the_exact_conversion_and_the_retrofit_applies_the_shipped_depth_parameters(
        installed, real_default_model):
    """`attnres-serve`'s default and `builtin:smollm2-135m-attnres-retrofit`, resolved by the installed
    package against the cache the real default was built in: the default holds zero pseudo-queries, the
    retrofit's folder is named for the installed depth file and holds exactly its parameters."""
    root, _ = real_default_model
    got = installed.run("""
import json, pathlib, torch
from safetensors.torch import load_file
from attnres.models import depth_parameters_path
from attnres.serving.defaults import RETROFIT_MODEL, resolve_default, resolve_model
def weights(folder):
    found = {}
    for shard in pathlib.Path(folder).glob("*.safetensors"):
        found.update(load_file(shard))
    return found
folder, name = resolve_default()
default = weights(folder)
retrofit_folder = resolve_model(RETROFIT_MODEL)
retrofit, depth = weights(retrofit_folder), load_file(depth_parameters_path())
print(json.dumps({"folder": folder, "name": name, "retrofit_folder": retrofit_folder, "count": len(depth),
                  "default_queries_zero": all(not v.any() for k, v in default.items() if "_res_proj" in k),
                  "equal": all(torch.equal(retrofit[k], v.to(retrofit[k].dtype)) for k, v in depth.items()),
                  "nonzero": sum(bool(v.abs().sum() > 0) for k, v in depth.items() if "_res_proj" in k)}))
""", env={"ATTNRES_CACHE_DIR": str(root)})
    digest = hashlib.sha256((REPO / "models" / "smollm2-135m-attnres-depth.safetensors").read_bytes()).hexdigest()
    assert got["name"] == "smollm2-135m-attnres" and "-depth-" not in got["folder"], got
    assert got["default_queries_zero"], got
    assert got["retrofit_folder"].endswith(f"-depth-{digest[:12]}"), got
    assert got["count"] > 0 and got["equal"] and got["nonzero"] > 0, got


def test_offline_the_default_falls_back_to_the_trained_shipped_model(installed, tmp_path):
    """No registry: one line says so and the shipped `attnres-tiny` is served, the very weights trained
    in this repository (not the random model)."""
    (tmp_path / "no-wheels").mkdir()
    got = installed.run("""
import hashlib, json, pathlib
from attnres.serving.defaults import resolve_default
folder, name = resolve_default()
weights = pathlib.Path(folder) / "model.safetensors"
print(json.dumps({"folder": folder, "name": name, "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}))
""", env={"ATTNRES_CACHE_DIR": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null",
          "PIP_FIND_LINKS": str(tmp_path / "no-wheels")})
    trained = hashlib.sha256((REPO / "models" / "attnres-tiny" / "model.safetensors").read_bytes()).hexdigest()
    assert got["name"] == "attnres-tiny" and got["folder"].startswith(str(installed.root / "env")), got
    assert got["sha256"] == trained, got


def test_a_missing_shipped_file_is_refused_in_one_line(installed, tmp_path):
    """The depth file removed from the install: the retrofit built-in, which applies it, is refused (one
    line, exit 1), never built without it."""
    env_models = next((installed.root / "env").rglob("attnres/models"))
    depth = env_models / "smollm2-135m-attnres-depth.safetensors"
    aside = depth.rename(tmp_path / depth.name)
    try:
        done = run_bounded([str(installed.root / "env" / "bin" / "attnres-serve"),
                            "builtin:smollm2-135m-attnres-retrofit", "--port", "1"], timeout=180,
                           cwd=installed.cwd, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                                   "ATTNRES_CACHE_DIR": str(tmp_path / "cache")})
    finally:
        aside.rename(depth)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("attnres-serve: error: the attnres package ships smollm2-135m-attnres-depth"), lines
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
