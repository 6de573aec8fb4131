"""The episode helper (`sandbox/helper/*.c`), built once per source version.

The helper runs inside task containers of every kind of image (Debian, Alpine, images with
no libc at all), so it is linked statically and bind-mounted in; nothing of the image is
used. It is compiled with the host's C compiler (`cc`, glibc's static libc: Debian's
build-essential / libc6-dev) into tmax's cache, named by a hash of its source, on first
use; several processes building at once each rename their own build into place.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tmax.common.files import cache_dir

SOURCES = sorted(Path(__file__).with_name("helper").glob("*.[ch]"))


class HelperUnavailable(RuntimeError):
    """The helper cannot be built here: episodes fall back to a fresh container each."""


@functools.cache
def helper_binary() -> Path:
    """The built helper for this source (built now if it is not in the cache)."""
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in SOURCES)).hexdigest()
    out = cache_dir() / "overlay" / f"tmax-eph-{digest[:16]}"
    if out.is_file() and os.access(out, os.X_OK):
        return out
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise HelperUnavailable("no C compiler (cc) to build the episode helper; install build-essential")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmax-eph-", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, "-static", "-O2", "-o", tmp, *(str(p) for p in SOURCES if p.suffix == ".c")],
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise HelperUnavailable(f"building the episode helper failed (static libc missing? install "
                                    f"libc6-dev): {r.stderr.strip()[-1000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
