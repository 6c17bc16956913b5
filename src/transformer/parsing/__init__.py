"""§6.3 constituency parsing: trees and their linearization, EVALB, the parsing corpus, `parse`.

A leaf of the package: only the command line imports it; the core never does.
"""
