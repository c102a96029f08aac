"""TLS and basic auth for the agent's listener, from Prometheus' exporter web-config file.

The file has the format every official Prometheus exporter reads with
``--web.config.file`` (prometheus/exporter-toolkit, ``docs/web-configuration.md``)::

    tls_server_config:
      cert_file: server.crt          # relative paths: from the web-config file's folder
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional
      client_ca_file: clients-ca.crt                  # needed by the Verify* types
      min_version: TLS12                              # optional: TLS10 .. TLS13
      max_version: TLS13
    basic_auth_users:
      prometheus: $2y$10$...         # a bcrypt hash, e.g. from htpasswd -nBC 10 prometheus

Supported ``client_auth_type`` values: ``NoClientCert`` (default), ``VerifyClientCertIfGiven``
and ``RequireAndVerifyClientCert``; Python's ``ssl`` cannot ask for an unverified client
certificate, so ``RequestClientCert`` and ``RequireAnyClientCert`` are refused with an error.
Other exporter-toolkit keys (``cipher_suites``, ``curve_preferences``,
``http_server_config``, ...) are refused too, rather than silently ignored.

With ``basic_auth_users`` every path of the listener (``/metrics``, ``/healthz``, ``/api``,
``/v1/traces``) needs a user's password; a wrong or missing one is a 401 with
``WWW-Authenticate: Basic``. bcrypt is slow by design, so hashes are checked on a worker
thread and a successful check is remembered (at most 256 credentials, keyed by a SHA-256 of
user, password and hash), as exporter-toolkit does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from kvpressure.agent.config import ConfigError, read_text
from kvpressure.agent.httpd import Handler, Request, Response, answer

_CACHE_MAX: Final = 256
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TlsServerConfig(_Model):
    """``tls_server_config`` (see the module doc)."""

    cert_file: str
    key_file: str
    client_auth_type: Literal[
        "NoClientCert", "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"
    ] = "NoClientCert"
    client_ca_file: str | None = None
    min_version: Literal["TLS10", "TLS11", "TLS12", "TLS13"] = "TLS12"
    max_version: Literal["TLS10", "TLS11", "TLS12", "TLS13"] | None = None


class WebConfig(_Model):
    """The whole web-config file."""

    tls_server_config: TlsServerConfig | None = None
    basic_auth_users: dict[str, str] = {}


class WebSecurity:
    """The listener's TLS context and basic-auth middleware, built from a web-config file.

    Args:
        config: the parsed file.
        base: the folder relative paths in the file are resolved from.

    Raises:
        ConfigError: a certificate, key or CA file cannot be loaded, or a user's hash is not
            a bcrypt hash (one line, naming the file or user).
    """

    def __init__(self, config: WebConfig, base: Path) -> None:
        self.config = config
        self.ssl_context = _ssl_context(config.tls_server_config, base)
        self._users = {u: h.encode() for u, h in config.basic_auth_users.items()}
        for user, hashed in self._users.items():
            if not hashed.startswith((b"$2a$", b"$2b$", b"$2y$")):
                raise ConfigError(f"basic_auth_users.{user}: expected a bcrypt hash ($2y$...)")
        if self._users:
            # loaded here, at start, only for a listener with users: bcrypt's library is
            # ~0.4 MiB of resident memory an agent without basic auth does not need
            import bcrypt  # noqa: F401
        self._ok: dict[bytes, None] = {}
        self.exempt: Callable[[Request], bool] = lambda _request: False
        """Requests the basic-auth middleware lets through because their handler checks
        its own credentials (the OTLP receiver with a bearer token)."""

    @property
    def auth_required(self) -> bool:
        """True when ``basic_auth_users`` lists at least one user."""
        return bool(self._users)

    async def middleware(self, request: Request, handler: Handler) -> Response:
        """Answer 401 unless the request carries a listed user's password.

        An :data:`agent.httpd.Middleware`.
        """
        if (
            self._users
            and not self.exempt(request)
            and not await self._authorized(request.headers.get("Authorization", ""))
        ):
            return Response(
                status=401,
                text="Unauthorized\n",
                headers={"WWW-Authenticate": 'Basic realm="kvpressure"'},
            )
        return await answer(handler, request)

    async def _authorized(self, header: str) -> bool:
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic" or not value:
            return False
        try:
            user, sep, password = base64.b64decode(value.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        hashed = self._users.get(user.decode("utf-8", "replace"))
        if not sep or hashed is None:
            return False
        key = hashlib.sha256(user + b"\0" + password + b"\0" + hashed).digest()
        if key in self._ok:
            return True
        ok = await asyncio.to_thread(_checkpw, password, hashed)
        if ok:
            self._ok[key] = None
            while len(self._ok) > _CACHE_MAX:
                del self._ok[next(iter(self._ok))]
        return ok


def _checkpw(password: bytes, hashed: bytes) -> bool:
    import bcrypt  # loaded by WebSecurity when it has users

    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:
        return False


def _ssl_context(tls: TlsServerConfig | None, base: Path) -> ssl.SSLContext | None:
    if tls is None:
        return None

    def path(name: str) -> str:
        p = Path(name)
        return str(p if p.is_absolute() else base / p)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[tls.min_version]
    if tls.max_version:
        ctx.maximum_version = _VERSIONS[tls.max_version]
    try:
        ctx.load_cert_chain(path(tls.cert_file), path(tls.key_file))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_server_config: cannot load cert_file/key_file: {exc}") from None
    if tls.client_auth_type != "NoClientCert":
        if not tls.client_ca_file:
            raise ConfigError(
                f"tls_server_config: client_auth_type {tls.client_auth_type} needs client_ca_file"
            )
        try:
            ctx.load_verify_locations(path(tls.client_ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"tls_server_config: cannot load client_ca_file: {exc}") from None
        ctx.verify_mode = (
            ssl.CERT_REQUIRED
            if tls.client_auth_type == "RequireAndVerifyClientCert"
            else ssl.CERT_OPTIONAL
        )
    return ctx


def load_web_config(path: str | Path) -> WebSecurity:
    """Read a web-config file (a regular file of at most 1 MiB) and build its security.

    Args:
        path: the file, e.g. ``/etc/kvpressure/web.yaml``.

    Raises:
        ConfigError: one line per problem, naming the file and the setting.
    """
    path = Path(path)
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError):
        raise ConfigError(f"{path}: invalid YAML") from None
    try:
        config = WebConfig.model_validate(data or {})
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            what = "not supported" if err["type"] == "extra_forbidden" else err["msg"]
            lines.append(f"{path}: {where}: {what}")
        raise ConfigError("\n".join(lines)) from None
    try:
        return WebSecurity(config, path.parent)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
