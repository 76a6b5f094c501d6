// Loaded before any chart. Altair's html renderer checks VEGA_DEBUG before it
// fetches a library: when the recorded version equals the one it wants, it uses
// the copy already on the page (served from _static/vendor) instead of the CDN.
// Keep these equal to altair.VEGA_VERSION, VEGALITE_VERSION and VEGAEMBED_VERSION
// (tests/test_book.py checks them).
var VEGA_DEBUG = {vega_version: "6", vegalite_version: "6.4.1", vegaembed_version: "7"};
