"""``mpidl data fetch``: download an IDX dataset's files and check their SHA-256.

    mpidl data fetch --dataset fashion-mnist        # into ~/.local/share/mpidl/fashion-mnist
    mpidl data fetch --dataset mnist --data-dir data/mnist

Run it once, in one process (not under ``mpiexec``), on a machine that
reaches the internet, into a folder every node reads; ``mpidl train`` and
``mpidl.data.load_idx`` then find the files there (the default folder without
``--data-dir``: :func:`mpidl.data.user_dir`).

Each of the dataset's four gzipped files (:data:`mpidl.data.IDX_DATASETS`:
names, SHA-256 of the official files, mirrors) is handled alone:

* a file already in the folder with the official SHA-256 is kept;
* otherwise it is downloaded from the first mirror that serves it into a
  temporary file beside it, hashed as it arrives, and renamed to its name
  (``os.replace``, atomic) only if it arrived whole (as long as the server's
  ``Content-Length`` said) with the official SHA-256. A download that fails,
  is cut short or has another checksum leaves nothing behind, and the next
  mirror is tried; a file of the folder with another checksum is replaced.

If no mirror serves a file right, :class:`FetchError` names it and what each
mirror did (the command exits with status 1); the files fetched before it
stay, each complete and checked, and a second run fetches only the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import os
import sys
import tempfile
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Callable

from . import data

#: Seconds a mirror may stay silent (connecting, or between two reads) before it counts as failed.
TIMEOUT = 60.0
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A file that no mirror served whole with the official checksum."""


def sha256_of(path: str) -> str:
    """The SHA-256 of the file at ``path``, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, path: str, sha256: str, timeout: float = TIMEOUT) -> int:
    """Download ``url`` to ``path`` if its SHA-256 is ``sha256``; the bytes written.

    The data goes to a temporary file in ``path``'s folder, renamed to ``path``
    only once whole and checked; on any failure it is removed and ``path`` is as
    it was.

    Raises:
        FetchError: the download arrived short of its ``Content-Length``, or with
            another SHA-256.
        OSError, http.client.HTTPException: the mirror could not be reached or
            failed (``urllib.error.HTTPError`` for an HTTP error status).
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, part = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=folder)
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            expected = response.headers.get("Content-Length")
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
            if expected is not None and size != int(expected):
                raise FetchError(f"{url}: cut short after {size} of {expected} bytes")
            if digest.hexdigest() != sha256:
                raise FetchError(f"{url}: SHA-256 {digest.hexdigest()} ({size} bytes), not the official {sha256}")
            out.flush()
            os.fsync(out.fileno())
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part)
        raise
    with contextlib.suppress(OSError):  # make the rename durable where the folder can be opened
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return size


def fetch(
    folder: str,
    sha256: Mapping[str, str],
    mirrors: Sequence[str],
    timeout: float = TIMEOUT,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Make ``folder`` hold every file of ``sha256`` (name -> SHA-256) with that checksum,
    downloading those it lacks from ``mirrors`` (URLs of folders that hold the files) as the
    module docstring says; the files' paths. ``say`` reports each file.

    Raises:
        FetchError: a file no mirror served whole with its checksum (the files before
            it stay; it leaves nothing).
        OSError: ``folder`` cannot be created or written.
    """
    os.makedirs(folder, exist_ok=True)
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{folder}: not writable")
    paths = []
    for name, digest in sha256.items():
        path = os.path.join(folder, name)
        paths.append(path)
        if os.path.isfile(path) and sha256_of(path) == digest:
            say(f"{path}: present, SHA-256 checked")
            continue
        problems = []
        for mirror in mirrors:
            url = mirror.rstrip("/") + "/" + name
            try:
                size = download(url, path, digest, timeout)
            except (FetchError, OSError, http.client.HTTPException) as exc:
                problems.append(str(exc) if isinstance(exc, FetchError) else f"{url}: {exc}")
                continue
            say(f"{path}: {size:,} bytes from {url}, SHA-256 checked")
            break
        else:
            raise FetchError(f"{name}: no mirror served it whole with the official checksum: " + "; ".join(problems))
    return paths


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``mpidl data fetch`` options."""
    p.add_argument(
        "--dataset",
        default="fashion-mnist",
        choices=list(data.IDX_DATASETS),
        help="the dataset whose four IDX files to fetch (default fashion-mnist)",
    )
    p.add_argument(
        "--data-dir",
        metavar="DIR",
        help=f"the folder to put them in (default {data.user_dir('DATASET')}, where mpidl looks)",
    )
    p.add_argument(
        "--mirror",
        action="append",
        metavar="URL",
        help="a URL that serves the files (repeatable; default: the dataset's official ones); "
        "the checksums are the official files' all the same",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``mpidl data fetch`` with parsed ``args``: 0 when every file is there and checked, else 1."""
    source = data.IDX_DATASETS[args.dataset]
    folder = args.data_dir or data.user_dir(args.dataset)
    try:
        fetch(folder, source.sha256, args.mirror or source.mirrors)
    except (FetchError, OSError) as exc:
        print(f"mpidl data fetch: error: {exc}", file=sys.stderr)
        return 1
    flag = f" --data-dir {folder}" if args.data_dir else ""
    print(f"{source.title} is in {folder}: mpidl train --dataset {args.dataset}{flag} reads it")
    return 0
