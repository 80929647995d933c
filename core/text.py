"""Characters that no text encoding holds.

A lone UTF-16 surrogate (U+D800..U+DFFF on its own) reaches us in two ways: `os.fsdecode`
writes an undecodable byte of a file name as one (surrogateescape), and a JSON escape such as
`\\ud800` decodes to one. UTF-8 cannot encode it, so the tokenizer and both stores' drivers
refuse it. The places that keep such text out of a conversation or the store (observations,
stored text, tool-call arguments) share this one range.
"""

from __future__ import annotations

# For use inside a regular expression's character class: "[" + SURROGATES + "]".
SURROGATES = "\ud800-\udfff"
