"""What every layer of tmax needs: atomic files, waiting and retrying, process trees, the
shared error types and the typed Harbor records. Imports nothing else of tmax."""
