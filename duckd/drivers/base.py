"""What every boot driver is: DuckSpec (one duck to start) and the Driver interface."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class DuckSpec:
    """What a driver needs to know of one duck, and what it reports back."""
    index: int
    subnet: str = "loopback"
    address: tuple[str, int] | None = None      # known once booted
    handle: object = None                       # the driver's own (a process, ...)
    notes: dict = field(default_factory=dict)


class Driver(abc.ABC):
    """can_restart: whether restart() brings a failed duck back."""
    name = "abstract"
    can_restart = False

    def __init__(self, cfg, state_dir: Path, key_file: Path):
        self.cfg, self.state_dir, self.key_file = cfg, state_dir, key_file

    def specs(self) -> list[DuckSpec]:
        return [DuckSpec(i) for i in range(self.cfg.ducks)]

    @abc.abstractmethod
    async def boot(self, duck: DuckSpec) -> None:
        """Starts (or wakes) the duck and sets duck.address."""

    def exited(self, duck: DuckSpec) -> str | None:
        """Why the duck is known to be gone (a process that exited), else None."""
        return None

    async def restart(self, duck: DuckSpec) -> None:
        await self.stop(duck)
        await self.boot(duck)

    async def stop(self, duck: DuckSpec) -> None:
        pass

    async def close(self) -> None:
        """Removes what the driver made (namespaces, bridges)."""
