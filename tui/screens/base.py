"""`DataScreen`: a screen the app redraws from the dashboard's data at every tick."""

from __future__ import annotations

from abc import abstractmethod

from textual.screen import Screen

from ..messages import RedrawNeeded
from ..model import DashboardData


class DataScreen(Screen[None]):
    """A screen that draws the job: the app calls `refresh_view` when the data changed, and
    once more whenever the screen is shown again (what it drew may be stale: another screen
    was drawn meanwhile, the plot mode changed there). The screen itself never scrolls (its
    scroll bar would sit over the footer): its widgets scroll, each in its own room."""

    DEFAULT_CSS = """
    DataScreen { overflow: hidden hidden; }
    """

    def app_data(self) -> DashboardData:
        """The dashboard's data (the app's)."""
        return self.app.data  # type: ignore[attr-defined]

    def on_screen_resume(self) -> None:
        """Shown (again): draw everything at the next tick."""
        self.post_message(RedrawNeeded())

    @abstractmethod
    def refresh_view(self, data: DashboardData, now: float, plots: bool) -> None:
        """Redraw from `data` at time `now` (plots only when `plots`); runs under no lock:
        take what is needed through the screen's view in `tui/views/`."""
