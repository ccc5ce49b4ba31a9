"""Module source locations (go-getter syntax) and safe unpack/repack."""
