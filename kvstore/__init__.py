"""kvstore: an object-storage-first KV-cache service for vLLM (see README.md and kvstore.stores, .cache,
.engine, .agent; the vLLM side is kvstore.connector, the service and CLI kvstore.admin)."""

import pkgutil

# In a source checkout kvstore.connector, kvstore.admin and kvstore.migrations live in folders beside this one
# (setuptools package-dir), and the editable install lays the whole namespace out elsewhere on sys.path
# (build/__editable__.kvstore-*/kvstore). Run from the checkout's root, `import kvstore` finds this folder
# first; extending the search path lets the rest of the namespace come from that layout.
__path__ = pkgutil.extend_path(__path__, __name__)
