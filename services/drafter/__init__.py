"""sssd.drafter"""
