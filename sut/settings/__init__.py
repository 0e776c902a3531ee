"""Settings: the run's own (``run``), LoadGen's (``loadgen``), user.conf (``userconf``), the engine and backend
flags (``flags``) and flags + preset -> settings (``from_args``)."""
