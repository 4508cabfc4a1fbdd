"""A wheelhouse for ``scripts/gpu_check`` on a CUDA machine with torch installed and no package registry.

    python scripts/gpu_wheels.py [DIR] [--python-version 3.12] [--have FILE] [--keep-under-mb 1]

Downloads into DIR (default ``./.whl``, git-ignored) the wheels of ``scripts/gpu_requirements.txt``
and of everything they need, for CPython at ``--python-version`` on Linux x86_64, and builds the one
dependency published as source only (``antlr4-python3-runtime`` 4.9.3, the runtime of Hydra's
override parser; pure Python). Then it leaves out the wheels of projects the machine already has
(``--have FILE``: one project per line, ``name`` or ``name==version``, as ``pip list
--format=freeze`` writes), but only the large ones (over ``--keep-under-mb``) and only where the
version FILE gives satisfies every requirement on that project (a line without a version is taken
as fitting). The small wheels stay, so pip has them where the machine's version does not fit.

On the CUDA machine, ``bash scripts/gpu_check`` installs from ``./.whl`` (or ``$GPU_CHECK_WHEELS``)
with ``--no-index``: pip takes from DIR only what the machine's Python lacks (docs/cuda.md).
Prints one line per wheel left out and the wheelhouse's size; exits 1 when pip fails.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
REQUIREMENTS = REPO / "scripts" / "gpu_requirements.txt"
#: Published as an sdist only; pure Python, so the wheel built here serves any CPython 3.
SDIST_ONLY = ("antlr4-python3-runtime==4.9.3",)
#: glibc-based x86_64 tags pip must be told one by one (it matches each N exactly).
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34)) + (
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def read_have(path: Path) -> dict[str, Version | None]:
    """Project → the version the machine has (None where FILE gives none)."""
    have = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):  # pip's options and editable lines name no release
            name, _, version = line.split(" @ ", 1)[0].partition("==")
            have[canonicalize_name(name.strip())] = Version(version.strip()) if version else None
    return have


def requirements_of(wheel: Path, env: dict[str, str]) -> list[Requirement]:
    """The Requires-Dist entries of a wheel that apply on the target (markers evaluated, no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(ln.split(":", 1)[1].strip()) for ln in lines if ln.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env | {"extra": ""})]


def target_env(python_version: str) -> dict[str, str]:
    return {
        "python_version": python_version,
        "python_full_version": python_version + ".0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }


def leave_out(wheels: list[Path], have: dict[str, Version | None], keep_under: float, env: dict) -> list[Path]:
    """The wheels the machine can do without: large, held there, at a version every requirement accepts."""
    wanted = [Requirement(ln) for ln in REQUIREMENTS.read_text().splitlines() if ln.strip() and ln[0] != "#"]
    for wheel in wheels:
        wanted += requirements_of(wheel, env)
    out = []
    for wheel in wheels:
        name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        if name not in have or wheel.stat().st_size <= keep_under * 1e6:
            continue
        version = have[name]
        if version is None or all(version in r.specifier for r in wanted if canonicalize_name(r.name) == name):
            out.append(wheel)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, nargs="?", default=REPO / ".whl", help="the wheelhouse (default ./.whl)")
    ap.add_argument("--python-version", default="3.12", help="the CUDA machine's CPython, X.Y (default 3.12)")
    ap.add_argument("--have", type=Path, help="the projects the machine already has (name or name==version lines)")
    ap.add_argument("--keep-under-mb", type=float, default=1.0, help="wheels this small stay even if held there")
    args = ap.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python_version):
        ap.error(f"--python-version: expected X.Y such as 3.12, got {args.python_version!r}")
    if args.have and not args.have.is_file():
        ap.error(f"--have {args.have}: no such file (write the machine's `pip list --format=freeze` there)")
    args.dir.mkdir(parents=True, exist_ok=True)
    abi = "cp" + args.python_version.replace(".", "")
    try:
        pip("wheel", "-q", "--no-deps", "-w", str(args.dir), *SDIST_ONLY)
        target = ["--python-version", args.python_version, "--implementation", "cp", "--abi", abi]
        target += [arg for p in PLATFORMS for arg in ("--platform", p)]
        links = ["--find-links", str(args.dir), "-d", str(args.dir)]
        pip("download", "-q", "--only-binary=:all:", *links, *target, "-r", str(REQUIREMENTS))
    except subprocess.CalledProcessError as e:
        print(f"gpu_wheels: pip {e.cmd[3]} failed (exit {e.returncode}), see above; nothing left out", file=sys.stderr)
        return 1
    wheels = sorted(args.dir.glob("*.whl"))
    if args.have:
        for wheel in leave_out(wheels, read_have(args.have), args.keep_under_mb, target_env(args.python_version)):
            print(f"left out (the machine has it): {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB)")
            wheel.unlink()
    kept = sorted(args.dir.glob("*.whl"))
    print(f"{args.dir}: {len(kept)} wheels, {sum(w.stat().st_size for w in kept) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
