"""The file system under a convert: OUTPUT's lock, the work directory, the source's guard
against changes, disk space, and OS errors turned into one ``HetquantError`` line.

Leaves: nothing here imports the rest of ``hetquant.convert`` (plans are typed only)."""
