"""``python -m sut package``: the submission tree (``tree``), one scenario's runs (``scenario``), the
same-system checks (``same_system``), the log checks (``logs``) and the system/measurement files (``files``)."""
