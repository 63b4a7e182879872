"""The demo shop's analytics on its mirrors: `order_facts` (hourly) and `daily_sales`, built from
the customers, orders and order_items mirrors when the tables file says `shop_analytics: true`,
and the automation sensor that runs them."""
