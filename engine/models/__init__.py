"""Model descriptions: config mapping and tensor plans per architecture family."""
