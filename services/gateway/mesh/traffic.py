"""How a model's requests that name no version split between its versions (canaries, rollouts).

Smooth weighted round-robin (nginx's): over any window of N requests each version's count is
within one of its share, so a 10% canary gets every tenth request, not a random ~10%.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from shared.errors import KvmeshError, Reason


class TrafficSplit:
    def __init__(self) -> None:
        self._percent: dict[str, dict[str, float]] = {}  # model -> version -> percent
        self._credit: dict[str, dict[str, float]] = {}

    def set(self, model: str, percent: Mapping[str, float]) -> None:
        """Empty: no split (every ready version serves, by replica)."""
        if any(share < 0 for share in percent.values()) or (
            percent and abs(sum(percent.values()) - 100.0) > 1e-6
        ):
            raise KvmeshError(
                Reason.INVALID_ARGUMENT,
                f"traffic percents must be >= 0 and sum to 100, got {dict(percent)}",
            )
        if percent:
            self._percent[model] = dict(percent)
        else:
            self._percent.pop(model, None)
        self._credit.pop(model, None)

    def percent(self, model: str) -> dict[str, float]:
        return dict(self._percent.get(model, {}))

    def choose(self, model: str, ready_versions: Collection[str]) -> str | None:
        """The version for the next request, among those with a ready replica; None: no split
        applies (no split set, or none of its weighted versions is ready)."""
        weights = {
            version: share
            for version, share in self._percent.get(model, {}).items()
            if share > 0 and version in ready_versions
        }
        if not weights:
            return None
        credit = self._credit.setdefault(model, {})
        for version, share in weights.items():
            credit[version] = credit.get(version, 0.0) + share
        chosen = max(weights, key=lambda version: (credit[version], version))
        credit[chosen] -= sum(weights.values())
        return chosen
