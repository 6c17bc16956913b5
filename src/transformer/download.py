"""Resumable HTTP downloads with sha256 verification (stdlib only).

A download is written to `{dest}.part`. If that file already exists, the transfer resumes from
its end with an HTTP `Range` request. The finished file is checked against its sha256 (when one
is known) and only then renamed atomically to `dest`: a file at `dest` is always complete.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_USER_AGENT = "transformer-prepare/0.1 (+https://github.com/)"


class DownloadError(RuntimeError):
    """A download failed: network or server error, or a checksum mismatch."""


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download(
    url: str,
    dest: str | Path,
    sha256: str | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download `url` to `dest`, resuming a partial download and verifying its sha256.

    If `dest` already exists and matches `sha256` (or no checksum is known), nothing is fetched.

    Args:
        url: http(s) URL.
        dest: final path; the partial download lives at `{dest}.part`.
        sha256: expected hex digest of the whole file, or None when unknown (nothing verified).
        timeout: socket timeout in seconds.

    Returns:
        `dest` as a Path.

    Raises:
        DownloadError: HTTP/network error (the `.part` file is kept so a retry resumes) or
            checksum mismatch (the `.part` file is deleted: its bytes are wrong).
    """
    dest = Path(dest)
    if dest.exists():
        if sha256 is None or sha256_file(dest) == sha256:
            logger.info("%s: already downloaded", dest)
            return dest
        raise DownloadError(f"{dest}: exists but its sha256 is not {sha256}; delete it and retry")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    _fetch_to_part(url, part, timeout)
    if sha256 is not None:
        actual = sha256_file(part)
        if actual != sha256:
            part.unlink()
            raise DownloadError(
                f"{url}: sha256 mismatch: expected {sha256}, got {actual}; partial file removed"
            )
    else:
        logger.warning("%s: no known sha256, downloaded file not verified", url)
    os.replace(part, dest)
    logger.info("downloaded %s -> %s", url, dest)
    return dest


def _fetch_to_part(url: str, part: Path, timeout: float) -> None:
    """Append the missing bytes of `url` to `part`, resuming with a Range request."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": _USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status = response.status
            if offset and status == 200:
                # The server ignored Range: start over rather than append a second copy.
                logger.info("%s: server does not support resume, restarting", url)
                offset = 0
            elif offset and status != 206:
                raise DownloadError(f"{url}: unexpected HTTP {status} for a Range request")
            if offset:
                logger.info("%s: resuming at byte %d", url, offset)
            expected = response.headers.get("Content-Length")
            with open(part, "ab" if offset else "wb") as f:
                start = f.tell()
                shutil.copyfileobj(response, f, _CHUNK)
                received = f.tell() - start
            if expected is not None and received != int(expected):
                raise DownloadError(
                    f"{url}: connection closed after {received} of {expected} bytes; "
                    f"partial data kept in {part}, retry to resume"
                )
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:
            # Range not satisfiable: the .part file already holds the whole file.
            return
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise DownloadError(f"{url}: {e}; partial data kept in {part}, retry to resume") from e
