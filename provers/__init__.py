"""Server-side verifiers: the framework-free transcript verifier and the whitebox replay provers.

Pure functions with no Django: they take bytes and files and return verdicts.
"""
