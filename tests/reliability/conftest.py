"""The reliability suite reuses the app's store fixtures."""

from tests.app.conftest import store, store_template  # noqa: F401
