"""The run's processes: starting them on this host (:mod:`.launch`), one rank's failure told to the
others (:mod:`.board`), and the thread on every rank that ends it when a peer failed (:mod:`.watchdog`)."""

__all__: list[str] = []
