"""Everything that renders Envoy's configuration or names what Envoy and Sluice exchange."""
