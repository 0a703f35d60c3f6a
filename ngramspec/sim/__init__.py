"""The trace simulator, apart from the library: replay of recorded generations (`simulate`), the draft methods it
compares (`methods`), cost profiles that turn steps into time (`profiles`) and trace loading (`traces`).

The core (`ngramspec.cache`, `ngramspec.controller`, `ngramspec.layout`) never imports this package; the
simulator imports the core.
"""
