"""The CPU kernels' fast numerics built for another instruction set, checked where this CPU cannot run it.

    python bench/isa_check.py                 # AVX512-VNNI: natively if this CPU has it, else emulated
    python bench/isa_check.py --isa avx512bf16

``bench/isa_check/check.c`` links ``worker_svc/cpu_kernels/tiles.c`` built twice, for AVX2 and for ``--isa``,
and checks the second against the first (which the test suite checks against gguf-py and transformers) and
against a product in double precision: the same tiles, the same bits from integer dots, every row of a batch
equal to that row alone. Where this CPU lacks the set, the check runs in Bochs (Debian's ``bochs``, emulating
a Tiger Lake: AVX512 F/BW/VL and VNNI) on bare metal: ``boot.S`` enters long mode and turns on the AVX-512
state itself, ``runtime.c`` is the little of a C library the check needs, isolinux's ``mboot.c32`` loads it
from an ISO built here (packages from Debian's archive, installed on first use). It takes about half a minute.
(Linux does not boot there: Bochs 2.7 reports save-area sizes Linux refuses, and it then turns AVX off.)
Bochs 2.7 has no AVX512-BF16 nor AMX, so ``--isa avx512bf16`` and ``--isa amx`` run only on a CPU that has them; emulated, the bf16
tile loop is still checked with ``vdpbf16ps`` replaced by the two FMAs it equals (``isa.h``).
Never part of the tests or CI: the suite checks the set the CI machine has.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conveyor.cache import cache_root  # noqa: E402
from worker_svc import cpu_kernels  # noqa: E402

HERE = ROOT / "bench" / "isa_check"
KERNELS = ROOT / "worker_svc" / "cpu_kernels"
EXPORTED = ["tile_gemm", "tile_gemm_swiglu", "tile_repack", "tile_dequant_rows", "tile_isa", "tile_int8_max_rows",
            "tile_supported", "tile_work_bytes", "tile_amx_ready", "tile_bf16_configure"]
PACKAGES = ["bochs", "bochsbios", "vgabios", "bochs-term", "isolinux", "syslinux-common", "xorriso"]
FLAGS = ["-O2", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-std=gnu11"]
BARE = ["-ffreestanding", "-fno-pic", "-fno-pie", "-mno-red-zone", "-fno-stack-protector",
        "-fno-asynchronous-unwind-tables", "-fno-math-errno"]
SYSLINUX = Path("/usr/lib/syslinux/modules/bios")
BOCHSRC = """megs: 256
cpu: model=tigerlake, count=1, ips=200000000
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/vgabios/vgabios.bin
ata0-master: type=cdrom, path={iso}, status=inserted
boot: cdrom
com1: enabled=1, mode=file, dev={serial}
display_library: term
log: {log}
panic: action=fatal
clock: sync=none
"""


def objects(isa: str, folder: Path, extra: list[str]) -> list[str]:
    """tiles.c for AVX2 (avx2_ names) and for ``isa`` (isa_ names), and the check."""
    out = []
    for prefix, flags in (("avx2_", []), ("isa_", cpu_kernels.ISAS[isa][1])):
        obj = folder / f"{prefix}tiles.o"
        renames = [f"-D{name}={prefix}{name}" for name in EXPORTED]
        subprocess.run(["cc", *FLAGS, *extra, *flags, *renames, "-c", "-o", str(obj), str(KERNELS / "tiles.c")],
                       check=True)
        out.append(str(obj))
    subprocess.run(["cc", *FLAGS, *extra, "-c", "-o", str(folder / "check.o"), str(HERE / "check.c")], check=True)
    return [str(folder / "check.o"), *out]


def build_native(isa: str, out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["cc", "-fopenmp", "-o", str(out), *objects(isa, Path(tmp), ["-fopenmp"]), "-lm"], check=True)


def build_bare(isa: str, out: Path) -> None:
    """A flat image a multiboot loader starts (boot.S, runtime.c, the check), one thread, no operating system."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        parts = objects(isa, folder, BARE)
        subprocess.run(["cc", *FLAGS, *BARE, "-fno-builtin", "-fno-tree-loop-distribute-patterns", "-c", "-o",
                        str(folder / "runtime.o"), str(HERE / "runtime.c")], check=True)
        subprocess.run(["cc", "-c", "-o", str(folder / "boot.o"), str(HERE / "boot.S")], check=True)
        libgcc = subprocess.run(["cc", "-print-libgcc-file-name"], check=True, capture_output=True, text=True)
        elf = folder / "isa_check.elf"
        subprocess.run(["ld", "-T", str(HERE / "link.ld"), "-nostdlib", "-static", "--no-warn-rwx-segments", "-o",
                        str(elf), str(folder / "boot.o"), str(folder / "runtime.o"), *parts, libgcc.stdout.strip()],
                       check=True)
        subprocess.run(["objcopy", "-O", "binary", str(elf), str(out)], check=True)


def boot_iso(root: Path, image: Path) -> Path:
    """An ISO whose isolinux starts ``image`` through mboot.c32."""
    missing = [p for p in PACKAGES if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode]
    if missing:
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, capture_output=True)
    tree, iso = root / "iso", root / "isa_check.iso"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "isolinux").mkdir(parents=True)
    shutil.copy("/usr/lib/ISOLINUX/isolinux.bin", tree / "isolinux")
    for module in ("ldlinux.c32", "libcom32.c32", "mboot.c32"):
        shutil.copy(SYSLINUX / module, tree / "isolinux")
    shutil.copy(image, tree / "isolinux" / "check.bin")
    (tree / "isolinux" / "isolinux.cfg").write_text(
        "DEFAULT check\nPROMPT 0\nTIMEOUT 0\nLABEL check\n  KERNEL mboot.c32\n  APPEND check.bin\n")
    subprocess.run(["xorriso", "-as", "mkisofs", "-quiet", "-o", str(iso), "-b", "isolinux/isolinux.bin", "-c",
                    "isolinux/boot.cat", "-no-emul-boot", "-boot-load-size", "4", "-boot-info-table", str(tree)],
                   check=True, capture_output=True)
    return iso


def emulate(root: Path, iso: Path, timeout: float) -> str:
    """Boot the ISO in Bochs (its debugger build waits for a 'c'; its text display wants a terminal: script)."""
    serial, log = root / "serial.txt", root / "bochs.log"
    serial.unlink(missing_ok=True)
    (root / "bochsrc").write_text(BOCHSRC.format(iso=iso, serial=serial, log=log))
    (root / "commands").write_text("c\nquit\n")
    command = f"bochs-bin -q -f {root / 'bochsrc'} -rc {root / 'commands'}"
    started = time.monotonic()
    proc = subprocess.Popen(["script", "-qfc", command, "/dev/null"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while proc.poll() is None and time.monotonic() - started < timeout:
            time.sleep(2)
            if serial.exists() and "=== exit" in serial.read_text(errors="replace"):
                break
    finally:
        subprocess.run(["pkill", "-f", command], capture_output=True)
        proc.wait()
    print(f"(Bochs ran {time.monotonic() - started:.0f} s)")
    return serial.read_text(errors="replace") if serial.exists() else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default="avx512", choices=[name for name in cpu_kernels.ISAS if name != "avx2"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds the emulated run may take")
    args = parser.parse_args()
    root = cache_root() / "bench" / "isa_check"
    root.mkdir(parents=True, exist_ok=True)
    if args.isa in cpu_kernels.supported_isas():
        print(f"this CPU has {args.isa}: running natively")
        program = root / f"isa_check-{args.isa}"
        build_native(args.isa, program)
        sys.exit(subprocess.run([str(program)]).returncode)
    if args.isa in ("avx512bf16", "amx"):
        sys.exit(f"Bochs 2.7 emulates no AVX512-BF16 nor AMX: --isa {args.isa} runs only on a CPU that has it")
    print(f"this CPU lacks {args.isa}: running it in Bochs (a Tiger Lake), on bare metal")
    image = root / f"isa_check-{args.isa}.bin"
    build_bare(args.isa, image)
    output = emulate(root, boot_iso(root, image), args.timeout)
    print(output.strip() if output else "(no output)")
    sys.exit(0 if "isa_check: PASSED" in output and "=== exit 0" in output else 1)


if __name__ == "__main__":
    main()
