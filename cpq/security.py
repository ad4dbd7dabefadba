"""Who may connect: the file system for ``ipc://``, CURVE keys for ``tcp://``.

The broker runs whatever code its clients name, so an endpoint is a remote-code-execution
service by design; only the user who owns it may reach it. An ``ipc://`` socket lives in a
0700 directory (see :mod:`cpq.paths`). A ``tcp://`` endpoint is refused unless CURVE keys
exist (``cpq keys``): the broker then accepts only clients whose public key is in the
authorised folder. ``--insecure`` allows a plain tcp bind on a loopback address only.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from cpq import paths

KEYS_DIR_VAR = "CPQ_KEYS_DIR"


class InsecureEndpoint(RuntimeError):
    """A tcp endpoint without keys, or --insecure on a non-loopback address."""


def keys_dir() -> Path:
    explicit = os.environ.get(KEYS_DIR_VAR)
    return Path(explicit) if explicit else paths.state_dir() / "keys"


def authorized_dir(base: Path | None = None) -> Path:
    return (base or keys_dir()) / "authorized"


class KeysExist(FileExistsError):
    """``cpq keys`` would overwrite a key pair that brokers and clients already use."""


def generate_keys(base: Path | None = None, *, replace: bool = False) -> Path:
    """Create a server and a client key pair; authorise the client. Returns the folder.

    Existing keys are kept unless ``replace``: a new server key silently locks out every
    client that pinned the old one, and a new client key is not yet authorised by brokers
    that copied the old one, so regenerating must be a decision, not a side effect.
    """
    base = base or keys_dir()
    existing = sorted(
        path.name
        for name in ("server", "client")
        for path in (base / f"{name}.key", base / f"{name}.key_secret")
        if path.exists()
    )
    if existing and not replace:
        raise KeysExist(
            f"{base} already holds {', '.join(existing)}; brokers and clients may be using "
            "them. Pass --force to replace them (clients must then fetch the new server.key)."
        )
    base = paths.ensure_private_dir(base)
    zmq.auth.create_certificates(str(base), "server")
    zmq.auth.create_certificates(str(base), "client")
    for secret in base.glob("*.key_secret"):  # zmq writes them with the process umask
        secret.chmod(0o600)
    authorized = paths.ensure_private_dir(authorized_dir(base))
    shutil.copy(base / "client.key", authorized / "client.key")
    return base


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def _host(endpoint: str) -> str:
    rest = endpoint[len("tcp://") :]
    return rest.rsplit(":", 1)[0].strip("[]")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def configure_server(
    context: zmq.Context[Any], sock: zmq.Socket[Any], endpoint: str, insecure: bool
) -> ThreadAuthenticator | None:
    """Make ``sock`` a CURVE server for a tcp ``endpoint`` (or refuse the endpoint)."""
    if not is_tcp(endpoint):
        return None
    base = keys_dir()
    secret = base / "server.key_secret"
    if secret.exists():
        # Whoever can write the authorised folder decides who may run code here.
        paths.ensure_private_dir(base)
        paths.ensure_private_dir(authorized_dir(base))
        authenticator = ThreadAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(authorized_dir(base)))
        public, private = zmq.auth.load_certificate(str(secret))
        sock.curve_secretkey = private
        sock.curve_publickey = public
        sock.curve_server = True
        return authenticator
    if insecure:
        if not _is_loopback(_host(endpoint)):
            raise InsecureEndpoint(
                f"--insecure is only allowed on a loopback address, not {endpoint}"
            )
        return None
    raise InsecureEndpoint(
        f"{endpoint} is a tcp endpoint and no CURVE keys were found in {base}: anyone who "
        "can reach it could run code as you. Run `cpq keys` to create keys (and give clients "
        "the client key pair and server.key), or use --insecure on a loopback address."
    )


def configure_client(sock: zmq.Socket[Any], endpoint: str) -> None:
    if not is_tcp(endpoint):
        return
    base = keys_dir()
    client_secret, server_public = base / "client.key_secret", base / "server.key"
    if not (client_secret.exists() and server_public.exists()):
        return  # an --insecure loopback broker; a CURVE broker will not answer us
    public, private = zmq.auth.load_certificate(str(client_secret))
    server_key, _ = zmq.auth.load_certificate(str(server_public))
    sock.curve_secretkey = private
    sock.curve_publickey = public
    sock.curve_serverkey = server_key
