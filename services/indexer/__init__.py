"""sssd.indexer"""
