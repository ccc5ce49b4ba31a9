"""Fetching a module's source: an https archive download or a git clone into a work
directory, its subdirectory selected, packed as a .tar.gz within the size limit."""

from __future__ import annotations

from pathlib import Path

from proxy.config.settings import ModulesConfig
from proxy.core.executors import quick, slow
from proxy.core.models import ModuleAddress
from proxy.core.redaction import excerpt
from proxy.modules.packing import pack, select_subdir, unpack
from proxy.modules.sources import ModuleSource, UnsupportedSource
from proxy.upstream import git
from proxy.upstream.egress_gate import EgressGate
from proxy.upstream.http import UpstreamHTTP


class ModuleSourceFetcher:
    """Fetches module sources over https (through the upstream client) or git (through the
    egress gate, trusting git_ca_file) and packs them."""

    def __init__(self, http: UpstreamHTTP, config: ModulesConfig, git_ca_file: Path | None,
                 git_gate: EgressGate) -> None:
        self._http = http
        self._config = config
        self._git_ca_file = git_ca_file
        self._git_gate = git_gate

    async def fetch_packed(self, module: ModuleAddress, source: ModuleSource, work: Path,
                           packed: Path) -> None:
        """Fetch source into the work directory and pack the module's directory at packed."""
        tree = await self._fetch_tree(module, source, work)
        module_root = await quick(select_subdir, tree, source.subdir)
        await slow(pack, module_root, packed, self._config.max_archive_size)

    async def _fetch_tree(self, module: ModuleAddress, source: ModuleSource,
                          work: Path) -> Path:
        tree = work / "tree"
        limit = self._config.max_archive_size
        if source.kind == "git":
            await git.clone(source.url, source.ref, tree, time_limit=self._config.git_timeout,
                            ca_file=self._git_ca_file, gate=self._git_gate)
            return tree
        if source.archive is None:
            raise UnsupportedSource(f"module location {excerpt(source.url, 200)} is not an archive "
                                    "(no ?archive= and no known extension)")
        download = work / "source.archive"
        await self._http.download(source.url, module.hostname, download, limit)
        await slow(unpack, download, source.archive, tree, limit)
        return tree
