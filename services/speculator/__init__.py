"""sssd.speculator"""
