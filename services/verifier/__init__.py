"""sssd.verifier"""
