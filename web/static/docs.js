"use strict";
// The OpenAPI page (/docs): Swagger UI from the vendored bundle, started here rather than by an
// inline script (the Content-Security-Policy allows none). "Try it out" sends the CSRF token.
(() => {
  const root = document.getElementById("swagger-ui");
  const csrf = document.querySelector('meta[name="csrf-token"]')?.content || "";
  window.ui = SwaggerUIBundle({
    url: root.dataset.openapi,
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
    requestInterceptor: (request) => {
      request.headers["X-CSRF-Token"] = csrf;
      return request;
    },
  });
})();
