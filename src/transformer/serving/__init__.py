"""Serving a model: the HTTP server and its web page, and the CTranslate2 export.

A leaf of the package: only the command line imports it; the core never does.
"""
