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

from transformer.errors import UserError

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20
_USER_AGENT = "transformer-prepare/0.1 (+https://github.com/)"


class DownloadError(UserError):
    """A download failed: network or server error, or a checksum mismatch (one clean line from
    the CLI: the message names the URL or file and what went wrong)."""


def sha256_file(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes (sha256, or e.g. "md5" where only that is published)."""
    digest = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download(
    url: str,
    dest: str | Path,
    sha256: str | None = None,
    timeout: float = 60.0,
    md5: str | None = None,
) -> Path:
    """Download `url` to `dest`, resuming a partial download and verifying its sha256.

    If `dest` already exists and matches `sha256` (or no checksum is known), nothing is fetched.

    Args:
        url: http(s) URL.
        dest: final path; the partial download lives at `{dest}.part`.
        sha256: expected hex digest of the whole file, or None when unknown.
        timeout: socket timeout in seconds.
        md5: expected md5, for files whose publisher gives only that (sacreBLEU's WMT sets);
            with neither checksum nothing is verified.

    Returns:
        `dest` as a Path.

    Raises:
        DownloadError: HTTP/network error (the `.part` file is kept so a retry resumes) or
            checksum mismatch (the `.part` file is deleted: its bytes are wrong).
    """
    dest = Path(dest)
    expected = {k: v for k, v in (("sha256", sha256), ("md5", md5)) if v is not None}
    if dest.exists():
        wrong = [k for k, v in expected.items() if sha256_file(dest, k) != v]
        if not wrong:
            logger.info("%s: already downloaded", dest)
            return dest
        raise DownloadError(
            f"{dest}: exists but its {wrong[0]} is not {expected[wrong[0]]}; delete it and retry"
        )
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    _fetch_to_part(url, part, timeout)
    for algorithm, value in expected.items():
        actual = sha256_file(part, algorithm)
        if actual != value:
            part.unlink()
            raise DownloadError(
                f"{url}: {algorithm} mismatch: expected {value}, got {actual}; partial file removed"
            )
    if not expected:
        logger.warning("%s: no known checksum, downloaded file not verified", url)
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
