"""Masking of secrets in text that leaves the proxy: log lines, error bodies sent to clients,
command output. Pure: no I/O.

Masked: the userinfo of any URL (`https://user:token@host`, also inside go-getter forms such
as `git::https://...`), values of query parameters whose names look like credentials (token,
sig, signature, X-Amz-Credential, password, key, ...), credential header values
(`Authorization: Bearer ...`, `PRIVATE-TOKEN: ...`) and tokens in well-known formats
(GitLab `glpat-...`, GitHub `ghp_...`). Harmless parameters such as `ref` are kept.
"""

from __future__ import annotations

import logging
import re

MASK = "***"

# Parameter names that carry credentials: our own signed URLs (`sig`), cloud storage
# signatures (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token, X-Goog-Signature,
# Azure `sig`), go-getter's `sshkey`, and the usual token/password names.
_SECRET_WORDS = ("token", "sig", "key", "secret", "pass", "pwd", "auth", "credential",
                 "session", "jwt", "cookie")
_NAME_CHARS = r"A-Za-z0-9_.%\-"
# A parameter name and its `=` (the lookbehind keeps the engine from retrying inside a
# name); its value runs to the next of _VALUE_END.
_PARAM_NAME = re.compile(rf"(?<![{_NAME_CHARS}])([{_NAME_CHARS}]+)=")
_VALUE_END = re.compile(r"[&#\s'\"<>]")
# Everything between `scheme://` and the last `@` before the path is userinfo; usernames
# alone are often tokens too (`https://glpat-...@host`, `x-access-token:...`).
_USERINFO = re.compile(r"(?<![A-Za-z0-9+.\-])([A-Za-z][A-Za-z0-9+.\-]*://)[^/?#\s]*@")
_HEADER = re.compile(
    r"(?i)\b((?:proxy-)?authorization|private-token|job-token|deploy-token|x-auth-token"
    r"|x-api-key|api-key|cookie)(\s*[:=]\s*)(?:(bearer|basic|token|digest|negotiate)\s+)?"
    r"[^\s'\",;]+")
# A bare `Bearer <token>` outside a header; the token must look like one (a digit or
# punctuation, or long), so that prose such as "a bearer token is required" stays readable.
_BEARER = re.compile(r"(?i)\b(bearer)\s+(?:(?=[A-Za-z]*[0-9._~+/=%\-])[A-Za-z0-9._~+/=%\-]{6,}"
                     r"|[A-Za-z]{20,})")
_BASIC = re.compile(r"\b(Basic)\s+[A-Za-z0-9+/]{8,}={0,2}")
# Only text holding one of these can match the header patterns above (a cheap pre-check:
# every log line passes here).
_HEADER_HINTS = ("authorization", "token", "api-key", "cookie", "bearer", "basic")
# GitLab and GitHub token formats, wherever they appear.
_TOKEN_PREFIXES = ("glpat-", "gldt-", "glptt-", "glrt-", "glcbt-", "gloas-", "ghp_", "gho_",
                   "ghu_", "ghs_", "ghr_", "github_pat_")
_KNOWN_TOKEN = re.compile(
    rf"\b(?:{'|'.join(map(re.escape, _TOKEN_PREFIXES))})[A-Za-z0-9_\-]+")


def mask_secrets(text: str) -> str:
    """text (a URL, a log message, git's error output) with every credential replaced by
    ***."""
    if "@" in text and "://" in text:
        text = _USERINFO.sub(rf"\1{MASK}@", text)
    if "=" in text:
        text = _mask_params(text)
    lowered = text.lower()
    if any(hint in lowered for hint in _HEADER_HINTS):
        text = _HEADER.sub(_masked_header, text)
        text = _BEARER.sub(rf"\1 {MASK}", text)
        text = _BASIC.sub(rf"\1 {MASK}", text)
    if any(prefix in text for prefix in _TOKEN_PREFIXES):
        text = _KNOWN_TOKEN.sub(MASK, text)
    return text


def _mask_params(text: str) -> str:
    # Not one regex substitution: a harmless parameter's value may itself be a URL with a
    # secret parameter (`location=https://...?token=...`), so values are only skipped over
    # once masked.
    parts, done = [], 0
    for match in _PARAM_NAME.finditer(text):
        name = match.group(1).lower()
        if match.start() < done or not any(word in name for word in _SECRET_WORDS):
            continue
        end = _VALUE_END.search(text, match.end())
        parts += [text[done:match.end()], MASK]
        done = end.start() if end else len(text)
    return "".join(parts) + text[done:] if parts else text


def _masked_header(match: re.Match[str]) -> str:
    scheme = f"{match.group(3)} " if match.group(3) else ""
    return f"{match.group(1)}{match.group(2)}{scheme}{MASK}"


def excerpt(text: str, limit: int, *, tail: bool = False) -> str:
    """At most limit characters of text (its end with tail), masked before it is cut: a cut
    through a URL would hide the markers (`://`, `@`, `token=`) that masking looks for."""
    masked = mask_secrets(text)
    return masked[-limit:] if tail else masked[:limit]


class SecretMaskingFilter(logging.Filter):
    """A handler filter that masks secrets in every record it passes (message, arguments,
    traceback): the last line of defense for log calls that forgot to mask."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Mask the record in place; never drops it."""
        try:
            message = record.getMessage()
        except Exception:  # a broken log call: keep its text, not its arguments
            message = str(record.msg)
        record.msg, record.args = mask_secrets(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_secrets(record.exc_text)
        if record.stack_info:
            record.stack_info = mask_secrets(record.stack_info)
        return True


def install_log_masking(logger: logging.Logger | None = None) -> None:
    """Add SecretMaskingFilter to every handler of logger (the root logger by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, SecretMaskingFilter) for f in handler.filters):
            handler.addFilter(SecretMaskingFilter())
