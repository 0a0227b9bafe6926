"""etcd authentication: the credentials rollcall presents, the tokens etcd
hands out for them, and turning authentication on in an etcd rollcall
starts.

etcd (3.4) checks users and roles once authentication is enabled: a client
calls ``Authenticate`` with a user and password and gets a token, which
every later request carries in its ``token`` metadata; etcd forgets tokens
after ``--auth-token-ttl`` (300 s) without use, and refuses a token issued
before a change of users or roles. :class:`TokenKeeper` fetches a token
when there is none and drops it when etcd refuses it, so that the next
attempt authenticates again.

:func:`enable_auth` sets up what ``rollcall up``, ``rollcall etcd`` and the
compose deployment run with: a ``root`` user (etcd's administrator), a
``rollcall`` user whose role may read and write the ``/rollcall/`` prefix
and nothing else, and their passwords, generated once and kept in files of
mode 0600 in a directory of mode 0700, both created so. It is idempotent: a
second run with the same directory (a restarted etcd, a new cluster with
kept passwords) checks or repeats each step.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
from pyetcd import etcdrpc

from rollcall.membership.errors import EtcdCredentialsRefused
from rollcall.private import private_directory

log = logging.getLogger(__name__)

#: The user the rendezvous service authenticates as, and its role.
ROLLCALL_USER = "rollcall"
ROLLCALL_ROLE = "rollcall"
#: etcd's administrator (etcd requires it, with the role of the same name,
#: before it enables authentication).
ROOT_USER = "root"
#: Everything rollcall keeps in etcd is under this prefix.
PREFIX = b"/rollcall/"
#: Where :func:`enable_auth` keeps each user's password, in its directory.
PASSWORD_FILES = {ROOT_USER: "root.password", ROLLCALL_USER: "rollcall.password"}
#: etcd's answers, by (code, text in the details).
_NO_CREDENTIALS = (grpc.StatusCode.INVALID_ARGUMENT, "user name is empty")
_BAD_PASSWORD = (grpc.StatusCode.INVALID_ARGUMENT, "authentication failed")
_NOT_PERMITTED = (grpc.StatusCode.PERMISSION_DENIED, "permission denied")
_STALE_TOKEN = (
    (grpc.StatusCode.UNAUTHENTICATED, "invalid auth token"),
    (grpc.StatusCode.INVALID_ARGUMENT, "revision of auth store is old"),
)
_AUTH_DISABLED = (grpc.StatusCode.FAILED_PRECONDITION, "authentication is not enabled")
_EXISTS = "already exists"
#: etcd refuses requests on a member without a leader instead of waiting.
_REQUIRE_LEADER = (("hasleader", "true"),)


def _is(exc: grpc.RpcError, answer: tuple[grpc.StatusCode, str]) -> bool:
    return bool(exc.code() == answer[0] and answer[1] in (exc.details() or ""))


def is_stale_token(exc: grpc.RpcError) -> bool:
    """etcd no longer takes our token: authenticate again."""
    return any(_is(exc, answer) for answer in _STALE_TOKEN)


def answered_without_credentials(exc: grpc.RpcError) -> bool:
    """etcd served the request as far as checking who sent it (so it is up,
    with a leader for a linearizable read) and refused it for lack of
    credentials or permission."""
    return _is(exc, _NO_CREDENTIALS) or _is(exc, _NOT_PERMITTED)


def refusal(exc: grpc.RpcError, user: str | None) -> EtcdCredentialsRefused | None:
    """The named error for an etcd answer that refuses who we are, or
    None if ``exc`` is something else."""
    if _is(exc, _NO_CREDENTIALS):
        return EtcdCredentialsRefused(
            "etcd requires authentication and no credentials were given: pass --etcd-user "
            "and --etcd-password-file (rollcall up and rollcall etcd keep them in the "
            "'auth' directory of etcd's data directory)"
        )
    if _is(exc, _NOT_PERMITTED):
        return EtcdCredentialsRefused(
            f"etcd refused our credentials: user {user!r} is not permitted to read and write "
            f"{PREFIX.decode()} ({exc.details()}); grant it a role with readwrite on that prefix"
        )
    if _is(exc, _BAD_PASSWORD):
        return EtcdCredentialsRefused(
            f"etcd refused our credentials: {exc.details()} (user {user!r}); check "
            "--etcd-user and --etcd-password-file"
        )
    return None


@dataclass(frozen=True)
class EtcdCredentials:
    """A user and password for etcd (the password is never shown)."""

    user: str
    password: str = field(repr=False)

    @classmethod
    def from_file(cls, user: str, path: str | os.PathLike[str]) -> EtcdCredentials:
        """``user`` with the password held in ``path`` (trailing newline
        ignored). Raises ``ValueError`` with a one-line message."""
        if not user:
            raise ValueError("the etcd user name is empty")
        try:
            password = Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read etcd password file {path}: {exc.strerror}") from None
        if not password:
            raise ValueError(f"etcd password file {path} is empty")
        return cls(user, password)


def authenticate(channel: grpc.Channel, credentials: EtcdCredentials, timeout: float) -> str | None:
    """A token for ``credentials`` (None when etcd has authentication
    off). Raises :class:`EtcdCredentialsRefused` when etcd refuses them,
    ``grpc.RpcError`` when it cannot be asked."""
    request = etcdrpc.AuthenticateRequest(name=credentials.user, password=credentials.password)
    try:
        response = etcdrpc.AuthStub(channel).Authenticate(
            request, timeout=timeout, metadata=_REQUIRE_LEADER
        )
    except grpc.RpcError as exc:
        if _is(exc, _AUTH_DISABLED):
            return None
        refused = refusal(exc, credentials.user)
        if refused is not None:
            raise refused from None
        raise
    return str(response.token)


class TokenKeeper:
    """The current etcd token for one set of credentials, shared by every
    thread and channel of a store: fetched on first use, dropped when etcd
    refuses it (``invalidate``)."""

    def __init__(self, credentials: EtcdCredentials, timeout: float) -> None:
        self.credentials = credentials
        self._timeout = timeout
        self._token: str | None = None
        self._fetched = False
        self._lock = threading.Lock()
        self._warned_disabled = False

    def token(self, channel: grpc.Channel, timeout: float | None) -> str | None:
        with self._lock:
            if not self._fetched:
                # Its own timeout, not the call's: bcrypt may need more.
                self._token = authenticate(channel, self.credentials, self._timeout)
                self._fetched = True
                if self._token is None and not self._warned_disabled:
                    self._warned_disabled = True
                    log.warning(
                        "etcd has authentication off: anyone who can reach it can read and "
                        "change every job; the credentials of user %s are not needed",
                        self.credentials.user,
                    )
            return self._token

    def invalidate(self) -> None:
        with self._lock:
            self._fetched = False
            self._token = None


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),  # fmt: skip
    grpc.ClientCallDetails,
):
    pass


class TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the keeper's token to every call made on a channel; the token
    is fetched over ``channel`` itself (the raw one, without this)."""

    def __init__(self, keeper: TokenKeeper, channel: grpc.Channel) -> None:
        self._keeper = keeper
        self._channel = channel

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        token = self._keeper.token(self._channel, details.timeout)
        metadata = list(details.metadata or ())
        if token is not None:
            metadata.append(("token", token))
        return _CallDetails(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None),
        )  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)


# --- turning authentication on ----------------------------------------------------


def _password(directory: Path, user: str) -> str:
    """The password kept for ``user`` in ``directory``, generated now
    (mode 0600 from the moment the file exists) if there is none."""
    path = directory / PASSWORD_FILES[user]
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return EtcdCredentials.from_file(user, path).password
    try:
        os.fchmod(fd, 0o600)  # a strict umask may have taken the owner's bits too
        os.write(fd, secrets.token_urlsafe(24).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return EtcdCredentials.from_file(user, path).password


def password_file(directory: Path, user: str = ROLLCALL_USER) -> Path:
    return directory / PASSWORD_FILES[user]


def _ignore_existing(call: Callable[[], Any]) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        if _EXISTS not in (exc.details() or ""):
            raise


def _endpoint(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"etcd endpoint must look like http://HOST:PORT, got {url!r}")
    return f"{parts.hostname}:{parts.port}"


def enable_auth(
    endpoints: Sequence[str], directory: Path, timeout: float = 10.0
) -> EtcdCredentials:
    """Turn authentication on in the etcd at ``endpoints`` (plain HTTP;
    the first that answers is used), with the passwords kept in
    ``directory``; returns the ``rollcall`` user's credentials.

    If etcd already has it on, the kept passwords are checked instead.
    Raises ``ValueError`` (one line) when the directory is unsafe, and
    :class:`EtcdCredentialsRefused` when etcd has authentication on with
    other passwords than the kept ones (another data directory's etcd, or
    the passwords were changed since)."""
    private_directory(directory, "etcd credentials directory")
    root = EtcdCredentials(ROOT_USER, _password(directory, ROOT_USER))
    rollcall = EtcdCredentials(ROLLCALL_USER, _password(directory, ROLLCALL_USER))
    failure: grpc.RpcError | str = "no endpoint given"
    for url in endpoints:
        with grpc.insecure_channel(_endpoint(url)) as channel:
            try:
                _enable_on(channel, root, rollcall, timeout)
                return rollcall
            except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                failure = exc if isinstance(exc, grpc.RpcError) else "not reachable"
    why = failure if isinstance(failure, str) else failure.details()
    raise ValueError(f"cannot enable authentication on etcd at {', '.join(endpoints)}: {why}")


def _enable_on(
    channel: grpc.Channel, root: EtcdCredentials, rollcall: EtcdCredentials, timeout: float
) -> None:
    grpc.channel_ready_future(channel).result(timeout=timeout)
    if authenticate(channel, root, timeout) is not None:
        # On already: the kept passwords must be the ones etcd knows.
        authenticate(channel, rollcall, timeout)
        return
    stub = etcdrpc.AuthStub(channel)

    def call(method: str, **fields: Any) -> Callable[[], Any]:
        request = getattr(etcdrpc, f"Auth{method}Request")(**fields)
        return lambda: getattr(stub, method)(request, timeout=timeout, metadata=_REQUIRE_LEADER)

    _ignore_existing(call("RoleAdd", name=ROLLCALL_ROLE))
    permission = etcdrpc.Permission(
        permType=etcdrpc.Permission.READWRITE, key=PREFIX, range_end=_prefix_end(PREFIX)
    )
    call("RoleGrantPermission", name=ROLLCALL_ROLE, perm=permission)()
    _ignore_existing(call("RoleAdd", name=ROOT_USER))
    for user, role in ((root, ROOT_USER), (rollcall, ROLLCALL_ROLE)):
        try:
            call("UserAdd", name=user.user, password=user.password)()
        except grpc.RpcError as exc:
            if _EXISTS not in (exc.details() or ""):
                raise
            # Left by an earlier run stopped half-way: its password is the file's.
            call("UserChangePassword", name=user.user, password=user.password)()
        call("UserGrantRole", user=user.user, role=role)()
    stub.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=timeout, metadata=_REQUIRE_LEADER)
    log.info("etcd: authentication enabled (users %s and %s)", ROOT_USER, ROLLCALL_USER)


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])
