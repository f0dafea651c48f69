"""TLS for the brokers' own callers (``lmq-admin``, the operator, the reclaim job): the CA to trust and the
name to expect, from flags or ``LMQ_TLS_CA``/``LMQ_TLS_SERVER_NAME``, turned into gRPC channel arguments here
and nowhere else, so every caller checks a broker the same way.

These callers dial brokers by pod IP (the operator from EndpointSlices, the reclaim job from the headless
Service's DNS answers) or by ``localhost`` (``kubectl exec ... lmq-admin``): none of those is a name the
brokers' certificate has to carry. Every broker of a release serves the same certificate, so a caller checks it
against one fixed name that the certificate does carry (the chart's default: the client Service's DNS name),
given as the TLS server name. The broker is still authenticated (the CA signed a certificate for that name), only
not by the address dialled. Without a server name the dialled host is checked, as gRPC does by default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import grpc

from lmq_broker import errors

CA_ENV: Final = "LMQ_TLS_CA"
SERVER_NAME_ENV: Final = "LMQ_TLS_SERVER_NAME"


@dataclass(frozen=True, slots=True)
class ClientTls:
    """Speak TLS to brokers whose certificate ``ca_file`` (PEM) signed, checked against ``server_name``."""

    ca_file: Path
    server_name: str = ""  # empty: the host of the endpoint dialled

    def credentials(self) -> grpc.ChannelCredentials:
        """Read at each call: a channel made after the CA file changed (a renewed Secret) trusts the new CA."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_file.read_bytes())

    def options(self) -> tuple[tuple[str, str], ...]:
        """Channel options that go with ``credentials()``."""
        return (("grpc.ssl_target_name_override", self.server_name),) if self.server_name else ()


def client_tls(
    ca_file: str | Path | None = None, server_name: str | None = None, environ: Mapping[str, str] | None = None
) -> ClientTls | None:
    """The callers' TLS setting: the arguments (flags), else ``LMQ_TLS_CA``/``LMQ_TLS_SERVER_NAME``; None means
    plaintext. ``errors.InvalidArgument`` for a server name without a CA, or a CA file that cannot be read."""
    env = os.environ if environ is None else environ
    ca = str(ca_file) if ca_file else env.get(CA_ENV, "").strip()
    name = server_name if server_name is not None else env.get(SERVER_NAME_ENV, "").strip()
    if not ca:
        if name:
            raise errors.InvalidArgument(f"a TLS server name ({SERVER_NAME_ENV}) needs a CA file ({CA_ENV})")
        return None
    path = Path(ca)
    try:
        path.read_bytes()
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read the TLS CA file {path}: {exc.strerror}", path=str(path)) from None
    return ClientTls(path, name)
