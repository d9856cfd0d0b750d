"""The generation format: naming, the manifest and latest-pointer schemas, manifest signing,
and validation (structure, then sizes, then digests) over any storage reader.

Owns: what makes a generation committed and trusted. May import: ``errors``, ``progress``,
``storage`` (reading only). Never deserialises a pickle.
"""
