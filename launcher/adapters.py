"""A worker's LoRA adapters (runtime/lora.py): what ``--lora NAME=PATH`` and ``--lora-file FILE`` ask for, kept
loaded on its engine and registered for gateways.

``AdapterManager`` applies the desired set to a ``LoraEngine``: it loads the adapters new to it, then registers
each as a model of its own (``publish``); it withdraws those no longer wanted (``withdraw``, so that no new
request arrives), then unloads them. The ``--lora`` adapters are wanted for the worker's whole life; the
``--lora-file``'s are read again whenever the file changes (polled every ``POLL_S``: its size, time and content),
so that adapters come and go without a restart.

Nothing here stops the worker for a bad adapter once it serves: a file that cannot be read or parsed is logged
with the reason and ignored (what is loaded stays), an adapter that fails to load is logged and tried again at
the file's next change, others still load; an adapter loaded but not registered (etcd away) is registered
again at the next poll. At start, the ``--lora`` adapters are the worker's configuration: one that cannot be
loaded, or more than the engine holds, is a ConfigError (exit 2).
"""

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import msgspec

from runtime.errors import ConfigError, FlotillaError
from runtime.lora import MAX_NAME_LENGTH, AdapterSet, LoraAdapter, LoraEngine

log = logging.getLogger(__name__)

#: How often the ``--lora-file`` is looked at, in seconds.
POLL_S = 1.0
#: The name of an adapter: a served model name.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
_adapter_set = msgspec.json.Decoder(AdapterSet)


def check_adapter_name(name: str) -> str:
    """``name`` if an adapter may be served under it; raises ConfigError saying what a name may hold."""
    if not _NAME.fullmatch(name) or len(name) > MAX_NAME_LENGTH:
        raise ConfigError(
            f"{name!r} is not an adapter name: 1-{MAX_NAME_LENGTH} letters, digits, '.', '_', '-', ':' or '/', "
            "starting with a letter or digit"
        )
    return name


def parse_lora_flag(text: str) -> LoraAdapter:
    """``NAME=PATH`` (``--lora``) as an adapter; raises ConfigError for a bad name or a path that is not there."""
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise ConfigError(f"--lora {text!r}: give NAME=PATH (the adapter's served name and its folder or file)")
    check_adapter_name(name)
    if not Path(path).exists():
        raise ConfigError(f"--lora {name}={path}: {path} does not exist (give the adapter's folder or file)")
    return LoraAdapter(name=name, path=path)


def parse_adapter_set(data: bytes, source: str) -> AdapterSet:
    """The ``--lora-file`` content ``data``; raises ConfigError naming ``source`` and what is wrong."""
    try:
        adapters = _adapter_set.decode(data)
    except msgspec.DecodeError as exc:
        raise ConfigError(
            f'{source}: not an adapter set ({exc}); expected {{"adapters": [{{"name": ..., "path": ...}}], '
            '"generation": N}'
        ) from None
    names: set[str] = set()
    for adapter in adapters.adapters:
        check_adapter_name(adapter.name)
        if adapter.name in names:
            raise ConfigError(f"{source}: adapter {adapter.name!r} is listed twice")
        names.add(adapter.name)
    return adapters


def read_adapter_file(path: Path) -> AdapterSet:
    """The adapter set in ``path`` (no file: none). Raises ConfigError when it cannot be read or parsed."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return AdapterSet()
    except OSError as exc:
        raise ConfigError(f"--lora-file {path}: cannot be read: {exc.strerror or exc}") from None
    return parse_adapter_set(data, f"--lora-file {path}")


class AdapterManager:
    """Keeps ``engine``'s adapters as the ``--lora`` flags and the ``--lora-file`` say.

    ``publish(adapter)`` registers a loaded adapter for gateways, ``withdraw(name)`` takes its registration
    back; both may raise FlotillaError (logged, and retried for a publish).
    """

    def __init__(
        self,
        engine: LoraEngine,
        *,
        fixed: Iterable[LoraAdapter] = (),
        file: Path | None = None,
        publish: Callable[[LoraAdapter], Awaitable[None]],
        withdraw: Callable[[str], Awaitable[None]],
    ) -> None:
        self.engine = engine
        self.fixed = {adapter.name: adapter for adapter in fixed}
        self.file = file
        self._publish = publish
        self._withdraw = withdraw
        #: Adapters loaded on the engine, by name; those of them registered for gateways.
        self.loaded: dict[str, LoraAdapter] = {}
        self.published: set[str] = set()
        #: The file's adapters as last read well, and the generation they carry (None: not read yet).
        self._from_file: list[LoraAdapter] = []
        self.generation: int | None = None
        self._seen: tuple[int, int, int] | None = None  # the file's (size, mtime_ns, inode) last looked at
        self._content: bytes | None = None  # its content last read
        self.changed = asyncio.Event()  # set after every pass that looked at the file (tests await it)

    async def start(self) -> None:
        """Load and register the ``--lora`` adapters and the file's. Raises ConfigError for more ``--lora``
        adapters than the engine holds, or one that does not load (the file's are only logged)."""
        if len(self.fixed) > self.engine.max_loras:
            raise ConfigError(
                f"--lora gives {len(self.fixed)} adapters; the engine holds {self.engine.max_loras} at most "
                "(its max_loras)"
            )
        for adapter in self.fixed.values():
            try:
                await self.engine.load_lora(adapter.name, Path(adapter.path))
            except FlotillaError as exc:
                raise ConfigError(f"--lora {adapter.name}={adapter.path}: {exc}") from exc
            self.loaded[adapter.name] = adapter
            log.info("LoRA adapter %r loaded from %s", adapter.name, adapter.path)
        await self.poll()
        await self._publish_pending()

    async def watch(self) -> None:
        """Look at the file every POLL_S and apply its changes; register what could not be yet. Runs until
        cancelled; each adapter's failure is logged, never raised."""
        while True:
            await asyncio.sleep(POLL_S)
            await self.poll()
            await self._publish_pending()

    async def poll(self) -> None:
        """Apply the file if it changed since it was last looked at."""
        if self.file is not None and self._file_changed(self.file):
            await self._read_and_apply(self.file)
        self.changed.set()

    def _file_changed(self, path: Path) -> bool:
        try:
            stat = os.stat(path)
            seen = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        except FileNotFoundError:
            seen = (-1, 0, 0)
        except OSError as exc:
            log.warning("--lora-file %s cannot be looked at (%s): the adapters loaded stay", path, exc)
            return False
        if seen == self._seen:
            return False
        self._seen = seen
        return True

    async def _read_and_apply(self, path: Path) -> None:
        try:
            content = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            content = b""
        except OSError as exc:
            log.warning("--lora-file %s cannot be read (%s): the adapters loaded stay", path, exc)
            return
        if content == self._content:
            # Touched, not changed (written again as it was): a chance to retry the adapters that failed to load.
            await self.apply()
            return
        self._content = content
        try:
            desired = parse_adapter_set(content, f"--lora-file {path}") if content else AdapterSet()
        except ConfigError as exc:
            log.warning("%s; the adapters loaded stay", exc)
            return
        for adapter in desired.adapters:
            if adapter.name in self.fixed:
                log.warning("--lora-file %s: adapter %r is given by --lora too; --lora's stays", path, adapter.name)
        self._from_file = [adapter for adapter in desired.adapters if adapter.name not in self.fixed]
        self.generation = desired.generation
        await self.apply()

    async def apply(self) -> None:
        """Make the engine's adapters the ``--lora`` ones and the file's: withdraw and unload those no longer
        wanted (or wanted from another path), then load and register the new ones, as many as the engine holds."""
        desired = {**self.fixed, **{adapter.name: adapter for adapter in self._from_file}}
        for name, adapter in list(self.loaded.items()):
            if desired.get(name) != adapter:
                await self._remove(name)
        for name, adapter in desired.items():
            if name in self.loaded:
                continue
            if len(self.loaded) >= self.engine.max_loras:
                log.warning(
                    "LoRA adapter %r not loaded: the engine holds %d adapters at most (max_loras) and has %s",
                    name, self.engine.max_loras, ", ".join(sorted(self.loaded)),
                )  # fmt: skip
                continue
            try:
                await self.engine.load_lora(name, Path(adapter.path))
            except Exception as exc:  # an engine's own error too: one adapter must not stop the others
                log.warning("LoRA adapter %r from %s failed to load: %s (tried again when the file changes)",
                            name, adapter.path, exc)  # fmt: skip
                continue
            self.loaded[name] = adapter
            log.info("LoRA adapter %r loaded from %s", name, adapter.path)
        await self._publish_pending()

    async def _remove(self, name: str) -> None:
        """Withdraw ``name``'s registration first (no new request reaches it), then unload it."""
        self.published.discard(name)
        try:
            await self._withdraw(name)
        except FlotillaError as exc:
            log.warning("LoRA adapter %r: its registration could not be withdrawn (%s); it goes with the lease",
                        name, exc)  # fmt: skip
        del self.loaded[name]
        try:
            await self.engine.unload_lora(name)
        except Exception as exc:
            log.warning("LoRA adapter %r failed to unload: %s", name, exc)
        else:
            log.info("LoRA adapter %r unloaded", name)

    async def _publish_pending(self) -> None:
        for name, adapter in self.loaded.items():
            if name in self.published:
                continue
            try:
                await self._publish(adapter)
            except FlotillaError as exc:
                log.warning("LoRA adapter %r is loaded but not registered yet (%s); tried again in %g s",
                            name, exc, POLL_S)  # fmt: skip
                continue
            self.published.add(name)
