"""Signing keys and OIDC tokens for the tests, as an issuer makes them: RSA and EC keys of
our own, their public halves as a JWKS, and JWTs signed with PyJWT (claims chosen by the
test: expired, not yet valid, another audience...)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

ISSUER = "https://token.actions.githubusercontent.com"
AUDIENCE = "tf-registry-proxy"


@dataclass
class SigningKey:
    """A private key, its key ID and algorithm."""

    algorithm: str  # RS256 or ES256
    kid: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    private: Any = None

    def __post_init__(self) -> None:
        if self.private is None:
            self.private = (rsa.generate_private_key(public_exponent=65537, key_size=2048)
                            if self.algorithm.startswith("RS")
                            else ec.generate_private_key(ec.SECP256R1()))

    def public_jwk(self) -> dict[str, Any]:
        """The public key as a JWK, with its kid and alg."""
        algorithm = jwt.get_algorithm_by_name(self.algorithm)
        found: dict[str, Any] = json.loads(algorithm.to_jwk(self.private.public_key()))
        return {**found, "kid": self.kid, "alg": self.algorithm, "use": "sig"}

    def public_pem(self) -> bytes:
        return bytes(self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    def sign(self, claims: dict[str, Any], kid: str | None = None) -> str:
        """A JWT of claims, signed with this key."""
        return jwt.encode(claims, self.private, algorithm=self.algorithm,
                          headers={"kid": kid or self.kid})


def jwks(*keys: SigningKey) -> dict[str, Any]:
    """A JWKS document of the keys' public halves."""
    return {"keys": [key.public_jwk() for key in keys]}


def claims(subject: str = "repo:acme/infra:ref:refs/heads/main", lifetime: float = 600,
           **more: Any) -> dict[str, Any]:
    """A GitHub Actions token's claims, for this proxy, valid now for lifetime seconds."""
    now = int(time.time())
    return {"iss": ISSUER, "aud": AUDIENCE, "sub": subject, "iat": now, "nbf": now,
            "exp": now + int(lifetime), "repository": "acme/infra", "repository_owner": "acme",
            "ref": "refs/heads/main", "job_workflow_ref": "acme/infra/.github/workflows/ci.yml",
            **more}


def unsigned(claims_: dict[str, Any]) -> str:
    """A token with `alg: none` (no signature)."""
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims_)}."


def hs256_with(secret: bytes, claims_: dict[str, Any], kid: str) -> str:
    """A token 'signed' HS256 with secret (e.g. a public key's PEM as the HMAC key)."""
    header = {"alg": "HS256", "typ": "JWT", "kid": kid}

    def part(value: bytes) -> str:
        return base64.urlsafe_b64encode(value).decode().rstrip("=")
    signing_input = f"{part(json.dumps(header).encode())}.{part(json.dumps(claims_).encode())}"
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{part(signature)}"
