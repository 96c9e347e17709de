"""A plugin whose module cannot be imported."""

import cacheon_module_that_does_not_exist  # noqa: F401
