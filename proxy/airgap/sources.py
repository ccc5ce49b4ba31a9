"""What to warm or export: requirements read from a Terraform configuration directory (its
`required_providers` and registry `module` blocks, through local modules), a
`.terraform.lock.hcl`, or a plain list file (`registry.terraform.io/hashicorp/aws ~> 5.0`,
`acme/net/aws 1.2.0`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import hcl2

from proxy.core.constraints import parse_constraint
from proxy.core.errors import BadRequest
from proxy.core.models import ModuleAddress, ProviderAddress

DEFAULT_HOST = "registry.terraform.io"


class SourceError(Exception):
    """A SOURCE argument that cannot be read."""


@dataclass(frozen=True)
class Requirement:
    """A provider or registry module, with the version constraint wanted ("" = newest)."""

    address: ProviderAddress | ModuleAddress
    constraint: str = ""

    def __post_init__(self) -> None:
        try:
            parse_constraint(self.constraint)
        except ValueError as exc:
            raise SourceError(f"{self.address}: {exc}") from None

    @property
    def kind(self) -> str:
        """"provider" or "module"."""
        return "provider" if isinstance(self.address, ProviderAddress) else "module"


@dataclass(frozen=True)
class CliRequirement:
    """A Terraform or OpenTofu CLI release wanted (`warm --cli PRODUCT VERSION`): an exact
    version or a constraint ("" = newest)."""

    product: str
    constraint: str = ""
    kind: ClassVar[str] = "cli"

    def __post_init__(self) -> None:
        try:
            parse_constraint(self.constraint)
        except ValueError as exc:
            raise SourceError(f"--cli {self.product}: {exc}") from None

    @property
    def address(self) -> str:
        """What the requirement names, for messages: the product."""
        return self.product


def read_sources(sources: list[str]) -> list[Requirement]:
    """Every requirement named by the SOURCE arguments, each once."""
    found: dict[tuple[str, str], Requirement] = {}
    for source in sources:
        path = Path(source)
        if path.is_dir():
            items = _from_configuration(path, set())
        elif path.name.endswith(".lock.hcl"):
            items = _from_lock_file(path)
        elif path.is_file():
            items = _from_list(path)
        else:
            raise SourceError(f"{source}: no such file or directory")
        for item in items:
            found.setdefault((str(item.address), item.constraint), item)
    return list(found.values())


def _text(value: object) -> str:
    """python-hcl2 keeps string quotes; take them off."""
    text = str(value).strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1]
    return text


def _load(path: Path) -> dict[str, Any]:
    try:
        with open(path) as handle:
            return hcl2.load(handle)
    except Exception as exc:  # python-hcl2 raises lark's many error types
        raise SourceError(f"{path}: cannot parse HCL: {str(exc).splitlines()[0]}") from None


def _provider(source: str, where: str) -> ProviderAddress:
    parts = source.split("/")
    if len(parts) == 2:
        parts = [DEFAULT_HOST, *parts]
    if len(parts) != 3:
        raise SourceError(f"{where}: {source!r} is not a provider address")
    try:
        return ProviderAddress.parse(*parts)
    except BadRequest as exc:
        raise SourceError(f"{where}: {exc.message}") from None


def _module(source: str, where: str) -> ModuleAddress | None:
    """A registry module address, or None for other sources (local, git, https...)."""
    if source.startswith(("./", "../", "/")) or "::" in source or "://" in source:
        return None
    parts = source.split("//", 1)[0].split("/")
    if parts[0] in ("github.com", "bitbucket.org") or (len(parts) == 3 and "." in parts[0]):
        return None  # go-getter shorthands, not registry addresses
    if len(parts) == 3:
        parts = [DEFAULT_HOST, *parts]
    if len(parts) != 4 or "." not in parts[0]:
        return None
    try:
        return ModuleAddress.parse(*parts)
    except BadRequest as exc:
        raise SourceError(f"{where}: {exc.message}") from None


def _from_configuration(directory: Path, seen: set[Path]) -> list[Requirement]:
    if directory.resolve() in seen:
        return []
    seen.add(directory.resolve())
    found: list[Requirement] = []
    for path in sorted(directory.glob("*.tf")):
        document = _load(path)
        for block in document.get("terraform", []):
            for providers in block.get("required_providers", []):
                for name, spec in providers.items():
                    if name.startswith("__"):
                        continue
                    if isinstance(spec, dict):
                        source = _text(spec.get("source", f"hashicorp/{name}"))
                        constraint = _text(spec.get("version", ""))
                    else:  # legacy `name = "version"`
                        source, constraint = f"hashicorp/{name}", _text(spec)
                    found.append(Requirement(_provider(source, str(path)), constraint))
        for block in document.get("module", []):
            for spec in block.values():
                if not isinstance(spec, dict) or "source" not in spec:
                    continue
                source = _text(spec["source"])
                module = _module(source, str(path))
                if module is not None:
                    found.append(Requirement(module, _text(spec.get("version", ""))))
                elif source.startswith(("./", "../")):
                    found += _from_configuration(directory / source, seen)
    return found


def _from_lock_file(path: Path) -> list[Requirement]:
    found = []
    for block in _load(path).get("provider", []):
        for address, spec in block.items():
            version = _text(spec.get("version", "")) if isinstance(spec, dict) else ""
            found.append(Requirement(_provider(_text(address), str(path)), version))
    return found


def _from_list(path: Path) -> list[Requirement]:
    found: list[Requirement] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        address, _, constraint = line.partition(" ")
        where = f"{path}:{number}"
        parts = address.split("/")
        is_module = len(parts) == 4 or (len(parts) == 3 and "." not in parts[0])
        try:
            if is_module:
                module = _module(address, where)
                if module is None:
                    raise SourceError(f"{where}: {address!r} is not a registry module "
                                      "address")
                found.append(Requirement(module, constraint.strip()))
            else:
                found.append(Requirement(_provider(address, where), constraint.strip()))
        except SourceError as exc:
            message = str(exc)
            raise SourceError(message if message.startswith(where) else
                              f"{where}: {message}") from None
    return found
