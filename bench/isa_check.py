"""The CPU kernels' fast numerics built for another instruction set, checked where this CPU cannot run it.

    python bench/isa_check.py                 # AVX512-VNNI: natively if this CPU has it, else emulated
    python bench/isa_check.py --isa avx512bf16

``bench/isa_check.c`` links ``worker_svc/cpu_kernels/tiles.c`` built twice, for AVX2 and for ``--isa``, and
checks the second against the first (which the test suite checks against gguf-py and transformers) and
against a product in double precision: the same tiles, the same bits from integer dots, every row of a batch
equal to that row alone. Where this CPU lacks the set, the program runs in Bochs (Debian's ``bochs``,
emulating a Tiger Lake: AVX512 F/BW/VL and VNNI) on Debian's kernel, booted from an ISO built here with
isolinux and busybox (every package from Debian's archive, installed or downloaded on first use into
``~/.cache/conveyor/bench/isa_check``; the boot takes about 10 minutes at Bochs' ~15 million instructions a
second). Bochs 2.7 has no AVX512-BF16, so ``--isa avx512bf16`` runs only on a CPU that has it; the bf16 tile
loop is still checked emulated, with ``vdpbf16ps`` replaced by the two FMAs it equals (``isa.h``).
Never part of the tests or CI: the suite checks the set the CI machine has.
"""

from __future__ import annotations

import argparse
import glob
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

KERNELS = ROOT / "worker_svc" / "cpu_kernels"
EXPORTED = ["tile_gemm", "tile_repack", "tile_dequant_rows", "tile_isa", "tile_int8_max_rows", "tile_supported",
            "tile_work_bytes"]
PACKAGES = ["bochs", "bochsbios", "vgabios", "bochs-term", "busybox-static", "isolinux", "syslinux-common", "xorriso",
            "cpio"]
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
INIT = """#!/bin/sh
/bin/mount -t proc proc /proc
echo "=== flags: $(/bin/grep -o -w -E 'avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16' /proc/cpuinfo | /bin/sort -u | /bin/tr '\\n' ' ')"
/bin/isa_check
echo "=== exit $?"
/bin/poweroff -f
"""


def build(isa: str, out: Path) -> None:
    """The static check program: tiles.c for AVX2 (avx2_ names) and for ``isa`` (isa_ names)."""
    base = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off", "-std=gnu11", "-c"]
    objects = []
    with tempfile.TemporaryDirectory() as tmp:
        for prefix, flags in (("avx2_", []), ("isa_", cpu_kernels.ISAS[isa][1])):
            obj = Path(tmp) / f"{prefix}tiles.o"
            renames = [f"-D{name}={prefix}{name}" for name in EXPORTED]
            subprocess.run(["cc", *base, *flags, *renames, "-o", str(obj), str(KERNELS / "tiles.c")], check=True)
            objects.append(str(obj))
        subprocess.run(["cc", "-O2", "-static", "-fopenmp", "-o", str(out), str(ROOT / "bench" / "isa_check.c"),
                        *objects, "-lm"], check=True)


def install(root: Path) -> Path:
    """Bochs and the boot tools (apt), and Debian's kernel image (downloaded, unpacked here): the vmlinuz."""
    missing = [p for p in PACKAGES if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode]
    if missing:
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, capture_output=True)
    kernels = glob.glob(str(root / "kernel" / "boot" / "vmlinuz-*"))
    if not kernels:
        depends = subprocess.run(["apt-cache", "depends", "linux-image-amd64"], check=True, capture_output=True,
                                 text=True).stdout
        package = next(line.split(":", 1)[1].strip() for line in depends.splitlines() if "Depends:" in line)
        subprocess.run(["apt-get", "download", package], cwd=root, check=True, capture_output=True)
        deb = next(root.glob(f"{package}_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root / "kernel")], check=True)
        deb.unlink()
        kernels = glob.glob(str(root / "kernel" / "boot" / "vmlinuz-*"))
    return Path(kernels[0])


def boot_iso(root: Path, program: Path, kernel: Path) -> Path:
    """An ISO that boots the kernel with an initramfs of busybox and ``program``, run as init's one job."""
    tree, iso = root / "iso", root / "isa_check.iso"
    shutil.rmtree(tree, ignore_errors=True)
    initrd = root / "initrd"
    shutil.rmtree(initrd, ignore_errors=True)
    (initrd / "bin").mkdir(parents=True)
    (initrd / "proc").mkdir()
    shutil.copy(shutil.which("busybox") or "/bin/busybox", initrd / "bin" / "busybox")
    for tool in ("sh", "mount", "poweroff", "grep", "sort", "tr"):
        (initrd / "bin" / tool).symlink_to("busybox")
    shutil.copy(program, initrd / "bin" / "isa_check")
    (initrd / "init").write_text(INIT)
    (initrd / "init").chmod(0o755)
    (tree / "isolinux").mkdir(parents=True)
    listing = subprocess.run(["find", "."], cwd=initrd, check=True, capture_output=True).stdout
    archive = subprocess.run(["cpio", "-o", "-H", "newc"], cwd=initrd, input=listing, check=True,
                             capture_output=True).stdout
    subprocess.run(["gzip", "-1"], input=archive, check=True, stdout=open(tree / "isolinux" / "initrd.gz", "wb"))
    shutil.copy(kernel, tree / "isolinux" / "vmlinuz")
    shutil.copy("/usr/lib/ISOLINUX/isolinux.bin", tree / "isolinux")
    shutil.copy("/usr/lib/syslinux/modules/bios/ldlinux.c32", tree / "isolinux")
    (tree / "isolinux" / "isolinux.cfg").write_text(
        "DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL vmlinuz\n"
        "  APPEND initrd=initrd.gz console=ttyS0,115200 loglevel=3 nokaslr mitigations=off\n")
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
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while proc.poll() is None and time.monotonic() - started < timeout:
            time.sleep(5)
            if serial.exists() and "=== exit" in serial.read_text(errors="replace"):
                break
    finally:
        subprocess.run(["pkill", "-f", f"bochs-bin -q -f {root / 'bochsrc'}"], capture_output=True)
        proc.wait()
    print(f"(Bochs ran {time.monotonic() - started:.0f} s)")
    return serial.read_text(errors="replace") if serial.exists() else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isa", default="avx512", choices=[name for name in cpu_kernels.ISAS if name != "avx2"])
    parser.add_argument("--timeout", type=float, default=3600, help="seconds the emulated run may take")
    args = parser.parse_args()
    root = cache_root() / "bench" / "isa_check"
    root.mkdir(parents=True, exist_ok=True)
    program = root / f"isa_check-{args.isa}"
    build(args.isa, program)
    if args.isa in cpu_kernels.supported_isas():
        print(f"this CPU has {args.isa}: running natively")
        sys.exit(subprocess.run([str(program)]).returncode)
    if args.isa == "avx512bf16":
        sys.exit("Bochs 2.7 emulates no AVX512-BF16: --isa avx512bf16 runs only on a CPU that has it")
    print(f"this CPU lacks {args.isa}: running it in Bochs (a Tiger Lake)")
    iso = boot_iso(root, program, install(root))
    output = emulate(root, iso, args.timeout)
    lines = [line for line in output.splitlines() if line.startswith(("===", "isa_check", "checked", "FAIL"))]
    print("\n".join(lines) if lines else output[-3000:])
    sys.exit(0 if "isa_check: PASSED" in output and "=== exit 0" in output else 1)


if __name__ == "__main__":
    main()
