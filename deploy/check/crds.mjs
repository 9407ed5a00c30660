// Validates the custom resources in Kubernetes manifests against the schemas Istio, Envoy Gateway and
// the prometheus-operator publish for their CRDs, as generated into the npm packages
// @kubernetes-models/{istio,envoy-gateway,gateway-api,prometheus-operator} (installed, pinned, into
// .tools/crd-schemas by `scripts/tools.sh image`).
//
//   node deploy/check/crds.mjs SCHEMA_DIR [--plugin-configs OUT_DIR] FILE.yaml...
//
// For each YAML document:
//   - a kind listed in KINDS: validated against its CRD schema, then checked for unknown fields. A CRD
//     schema rarely forbids extra properties, yet the API server prunes them (or, with kubectl's strict
//     field validation, rejects them): a typo would silently lose a setting. Each field is probed by
//     replacing its value with one of the wrong type; a field the schema knows then fails validation
//     at that path, an unknown one does not. Free-form fields (plugin configuration, listed per kind)
//     are neither probed nor entered: the module validates its own configuration.
//   - a Kubernetes core kind (group without a dot, or *.k8s.io other than Gateway API): printed as
//     "core", for kubernetes-validate to check.
//   - anything else: an error (no schema to check it against).
// With --plugin-configs, each free-form plugin configuration is also written to
// OUT_DIR/<kind>-<name>-<n>.json: a second reading of where the configuration sits (node's YAML
// reader, the paths the CRD schemas leave free-form), used only as the oracle that
// server/tests/integration/check.rs holds `tollgate-server check`'s own reading against. What the
// project's tests run through the module is found by `tollgate-server check --write-configs`, the
// one reader of those places (server/src/check.rs, PLACES).
// Exit status 1 when any document fails.
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const args = process.argv.slice(2);
const schemaDir = args.shift();
let configsDir = null;
if (args[0] === "--plugin-configs") {
  args.shift();
  configsDir = args.shift();
}
const files = args;
if (!schemaDir || files.length === 0) {
  console.error("usage: node crds.mjs SCHEMA_DIR FILE.yaml...");
  process.exit(2);
}
const modules = join(schemaDir, "node_modules");
const load = (rel) => import(pathToFileURL(join(modules, rel)).href);

// apiVersion/kind -> [module file, exported class, free-form paths (dotted, "*" = any array index)]
const KINDS = {
  "extensions.istio.io/v1alpha1/WasmPlugin": [
    "@kubernetes-models/istio/extensions.istio.io/v1alpha1/WasmPlugin.js", "WasmPlugin", ["spec.pluginConfig"]],
  "security.istio.io/v1/AuthorizationPolicy": [
    "@kubernetes-models/istio/security.istio.io/v1/AuthorizationPolicy.js", "AuthorizationPolicy", []],
  "gateway.envoyproxy.io/v1alpha1/EnvoyExtensionPolicy": [
    "@kubernetes-models/envoy-gateway/gateway.envoyproxy.io/v1alpha1/EnvoyExtensionPolicy.js",
    "EnvoyExtensionPolicy", ["spec.wasm.*.config"]],
  "gateway.networking.k8s.io/v1/HTTPRoute": [
    "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute.js", "HTTPRoute", []],
  "gateway.networking.k8s.io/v1/GRPCRoute": [
    "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/GRPCRoute.js", "GRPCRoute", []],
  // Envoy configuration patches: free-form, and not plugin configurations (the 4th element).
  "networking.istio.io/v1alpha3/EnvoyFilter": [
    "@kubernetes-models/istio/networking.istio.io/v1alpha3/EnvoyFilter.js", "EnvoyFilter",
    ["spec.configPatches.*.patch.value"], false],
  "monitoring.coreos.com/v1/PrometheusRule": [
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule.js", "PrometheusRule", []],
  "monitoring.coreos.com/v1/ServiceMonitor": [
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor.js", "ServiceMonitor", []],
};

const YAML = (await load("yaml/dist/index.js")).default;

function errorsOf(Model, data) {
  const { apiVersion, kind, ...rest } = data;
  try {
    new Model(rest).validate();
    return [];
  } catch (e) {
    if (Array.isArray(e.errors)) return e.errors;
    return [{ instancePath: "", message: String(e.message || e) }];
  }
}

const pointer = (path) => "/" + path.map((p) => String(p).replaceAll("~", "~0").replaceAll("/", "~1")).join("/");
const dotted = (path) => path.map((p) => (typeof p === "number" ? "*" : p)).join(".");

function clone(v) {
  return JSON.parse(JSON.stringify(v));
}

function setAt(obj, path, value) {
  let o = obj;
  for (const p of path.slice(0, -1)) o = o[p];
  o[path[path.length - 1]] = value;
}

// Every key path in the document below apiVersion/kind, not entering free-form fields.
function fieldPaths(value, path, freeForm, out) {
  if (path.length > 0) {
    // Free-form: its type may be "any" (so a probe proves nothing) and its content is the module's.
    if (freeForm.includes(dotted(path))) return;
    if (typeof path[path.length - 1] === "string") out.push(path);
  }
  if (Array.isArray(value)) value.forEach((v, i) => fieldPaths(v, [...path, i], freeForm, out));
  else if (value && typeof value === "object")
    for (const k of Object.keys(value)) {
      if (path.length === 0 && (k === "apiVersion" || k === "kind")) continue;
      fieldPaths(value[k], [...path, k], freeForm, out);
    }
}

function unknownFields(Model, doc, freeForm) {
  const paths = [];
  fieldPaths(doc, [], freeForm, paths);
  const unknown = [];
  for (const path of paths) {
    const original = path.reduce((o, p) => o[p], doc);
    const probe = original !== null && typeof original === "object" && !Array.isArray(original) ? 7 : { probe: [[]] };
    const copy = clone(doc);
    setAt(copy, path, probe);
    const at = pointer(path);
    const hit = errorsOf(Model, copy).some((e) => e.instancePath === at || e.instancePath.startsWith(at + "/"));
    if (!hit) unknown.push(dotted(path));
  }
  return unknown;
}

// The values at the free-form paths ("*" = every array element).
function freeFormValues(doc, freeForm) {
  const found = [];
  const walk = (v, parts) => {
    if (v === undefined || v === null) return;
    if (parts.length === 0) return found.push(v);
    const [head, ...rest] = parts;
    if (head === "*") Array.isArray(v) && v.forEach((x) => walk(x, rest));
    else walk(v[head], rest);
  };
  for (const f of freeForm) walk(doc, f.split("."));
  return found;
}

function isCore(apiVersion) {
  const group = apiVersion.includes("/") ? apiVersion.split("/")[0] : "";
  if (group.startsWith("gateway.networking.")) return false;
  return !group.includes(".") || group.endsWith(".k8s.io");
}

let failed = 0;
for (const file of files) {
  const docs = YAML.parseAllDocuments(readFileSync(file, "utf8"));
  for (const d of docs) {
    if (d.errors.length > 0) {
      console.log(`FAIL ${file}: YAML: ${d.errors.map((e) => e.message).join("; ")}`);
      failed++;
      continue;
    }
    const doc = d.toJSON();
    if (doc === null || doc === undefined) continue;
    const id = `${file} ${doc.kind}/${doc.metadata?.name ?? "?"}`;
    const entry = KINDS[`${doc.apiVersion}/${doc.kind}`];
    if (!entry) {
      if (isCore(String(doc.apiVersion))) {
        console.log(`core ${id}`);
      } else {
        console.log(`FAIL ${id}: no schema for ${doc.apiVersion} ${doc.kind}`);
        failed++;
      }
      continue;
    }
    const [modulePath, exported, freeForm] = entry;
    const Model = (await load(modulePath))[exported];
    const errors = errorsOf(Model, doc);
    const unknown = errors.length === 0 ? unknownFields(Model, doc, freeForm) : [];
    if (errors.length > 0 || unknown.length > 0) {
      for (const e of errors) console.log(`FAIL ${id}: ${e.instancePath || "/"} ${e.message}`);
      for (const u of unknown) console.log(`FAIL ${id}: unknown field ${u}`);
      failed++;
    } else {
      console.log(`ok   ${id} (${modulePath.split("/").slice(0, 2).join("/")})`);
    }
    if (configsDir && entry[3] !== false) {
      freeFormValues(doc, freeForm).forEach((cfg, n) => {
        const out = join(configsDir, `${doc.kind}-${doc.metadata?.name ?? "unnamed"}-${n}.json`);
        writeFileSync(out, JSON.stringify(cfg));
      });
    }
  }
}
process.exit(failed > 0 ? 1 : 0);
