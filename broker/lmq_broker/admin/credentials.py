"""The admin key pair: where the broker and the admin callers find it, and the file the broker generates.

Admin calls change every tenant's metadata and delete lite topics, so the broker never serves them
anonymously by default, even with client auth off. With no pair configured, the first start writes one to
``<data-dir>/admin-credentials.json`` and every later start reads it back: whoever can read the broker's
data directory (its host, its pod) can administer it, nobody else. The file::

    {"access_key": "lmq-admin-3f9c0a1b2c3d4e5f", "secret_key": "<43 url-safe characters>"}

is written with mode 0600, to a temporary file that is fsynced and renamed over the name (then the
directory fsynced), so a crash leaves the old file, the new one, or none, never half a key.

Callers (``lmq-admin``, scripts) resolve their pair in the order: explicit flags, the
``LMQ_ADMIN_ACCESS_KEY``/``LMQ_ADMIN_SECRET_KEY`` variables (what the chart gives broker pods), the file
in ``--data-dir`` (``LMQ_DATA_DIR``, default ``./data``: where ``make run`` puts it).
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from lmq_broker import errors

FILE_NAME: Final = "admin-credentials.json"
FILE_MODE: Final = 0o600
ACCESS_KEY_ENV: Final = "LMQ_ADMIN_ACCESS_KEY"
SECRET_KEY_ENV: Final = "LMQ_ADMIN_SECRET_KEY"
DATA_DIR_ENV: Final = "LMQ_DATA_DIR"
DEFAULT_DATA_DIR: Final = Path("./data")
SECRET_BYTES: Final = 32


@dataclass(frozen=True, slots=True)
class KeyPair:
    access_key: str
    secret_key: str

    def __repr__(self) -> str:  # never print the secret
        return f"KeyPair(access_key={self.access_key!r}, secret_key='***')"


def path_in(data_dir: Path) -> Path:
    return data_dir / FILE_NAME


def new_secret(nbytes: int = SECRET_BYTES) -> str:
    """A random URL-safe secret that does not start with '-' (which a command line would read as a flag:
    ``--secret-key -Qv...`` fails in argparse; one secret in 64 would)."""
    while (secret := secrets.token_urlsafe(nbytes)).startswith("-"):
        pass
    return secret


def generate() -> KeyPair:
    return KeyPair(f"lmq-admin-{secrets.token_hex(8)}", new_secret())


def read(path: Path) -> KeyPair:
    """The pair in ``path``; ``errors.InvalidArgument`` when it is not a credentials file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise errors.InvalidArgument(f"cannot read admin credentials {path}: {exc}", path=str(path)) from None
    if not isinstance(data, dict):
        raise errors.InvalidArgument(f"{path} is not an admin credentials file", path=str(path))
    access_key, secret_key = data.get("access_key"), data.get("secret_key")
    if not isinstance(access_key, str) or not isinstance(secret_key, str) or not access_key or not secret_key:
        raise errors.InvalidArgument(f"{path} needs non-empty access_key and secret_key", path=str(path))
    return KeyPair(access_key, secret_key)


def write(path: Path, pair: KeyPair) -> None:
    """Atomically replace ``path`` with ``pair`` (mode 0600): temp file, fsync, rename, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    body = json.dumps({"access_key": pair.access_key, "secret_key": pair.secret_key}) + "\n"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(body)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def load_or_create(data_dir: Path) -> tuple[KeyPair, bool]:
    """The broker's side: the pair in ``data_dir``, generated there first if absent. Returns (pair, created)."""
    path = path_in(data_dir)
    if path.exists():
        return read(path), False
    pair = generate()
    write(path, pair)
    return pair, True


def too_open(path: Path) -> bool:
    """Whether others than the owner may read or write the file (someone loosened it after we wrote it)."""
    return bool(path.stat().st_mode & 0o077)


def resolve(
    access_key: str = "", secret_key: str = "", data_dir: Path | None = None, environ: Mapping[str, str] | None = None
) -> KeyPair | None:
    """The callers' side: flags, else the environment, else the file in ``data_dir`` (default: ``LMQ_DATA_DIR``,
    else ``./data``); None when none of them gives a pair (the call goes unsigned)."""
    env = os.environ if environ is None else environ
    if access_key or secret_key:
        if not (access_key and secret_key):
            raise errors.InvalidArgument("--access-key and --secret-key go together")
        return KeyPair(access_key, secret_key)
    access_key, secret_key = env.get(ACCESS_KEY_ENV, ""), env.get(SECRET_KEY_ENV, "")
    if access_key or secret_key:
        if not (access_key and secret_key):
            raise errors.InvalidArgument(f"set both {ACCESS_KEY_ENV} and {SECRET_KEY_ENV}, or neither")
        return KeyPair(access_key, secret_key)
    directory = data_dir if data_dir is not None else Path(env.get(DATA_DIR_ENV, "") or DEFAULT_DATA_DIR)
    path = path_in(directory)
    if not path.exists():
        return None
    return read(path)
