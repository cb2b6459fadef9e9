"""sssd.common"""
