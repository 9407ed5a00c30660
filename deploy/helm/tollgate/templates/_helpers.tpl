{{/* The release's name for every object: <release>-tollgate, or the release name alone when it
already says tollgate (`helm install tollgate ...` gives "tollgate", as deploy/kubernetes does). */}}
{{- define "tollgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tollgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* What selects the service's pods. */}}
{{- define "tollgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tollgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tollgate.labels" -}}
{{ include "tollgate.selectorLabels" . }}
app.kubernetes.io/part-of: tollgate
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The bundled Redis's: its own name, so the service's selector never matches it. */}}
{{- define "tollgate.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "tollgate.name" . }}-redis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tollgate.redisLabels" -}}
{{ include "tollgate.redisSelectorLabels" . }}
app.kubernetes.io/part-of: tollgate
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The Service's name in DNS: <fullname>.<namespace>.svc.<clusterDomain>. */}}
{{- define "tollgate.host" -}}
{{- printf "%s.%s.svc.%s" (include "tollgate.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{- define "tollgate.tokenSecret" -}}
{{- default (printf "%s-token" (include "tollgate.fullname" .)) .Values.token.existingSecret -}}
{{- end -}}

{{/* The takes' token of the Secret the chart makes, and of the WasmPlugin: one value, so the two
never differ. token.value when given (values.schema.json refuses a placeholder or fewer than 32
bytes, as the service does); else the token the release's Secret holds already, so an upgrade keeps
it (unless it is one the service would refuse: the placeholder earlier charts shipped); else 48
random letters and digits. Made once per render and kept in .Values.token for the templates after
the first. Where the chart cannot look the Secret up (`helm template`, a dry run, Argo CD), every
render makes a new one: set token.value or token.existingSecret there. */}}
{{- define "tollgate.token" -}}
{{- $t := .Values.token -}}
{{- if not (hasKey $t "rendered") -}}
{{- $value := $t.value -}}
{{- if not $value -}}
{{- $found := lookup "v1" "Secret" .Release.Namespace (include "tollgate.tokenSecret" .) -}}
{{- $kept := "" -}}
{{- if $found.data -}}
{{- $kept = index $found.data $t.key | default "" | b64dec -}}
{{- end -}}
{{- if and (ge (len $kept) 32) (not (contains "replace-with" (lower $kept))) -}}
{{- $value = $kept -}}
{{- else -}}
{{- $value = randAlphaNum 48 -}}
{{- end -}}
{{- end -}}
{{- $_ := set $t "rendered" $value -}}
{{- end -}}
{{- $t.rendered -}}
{{- end -}}

{{- define "tollgate.rlsConfigMap" -}}
{{- default (printf "%s-rls-limits" (include "tollgate.fullname" .)) .Values.rls.existingConfigMap -}}
{{- end -}}

{{- define "tollgate.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The store's environment variables: exactly one of memory, standalone, Cluster or Sentinel. */}}
{{- define "tollgate.redisEnv" -}}
{{- $r := .Values.redis -}}
{{- if eq $r.mode "standalone" }}
{{- if $r.urlSecret.name }}
- name: TOLLGATE_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ $r.urlSecret.name | quote }}, key: {{ $r.urlSecret.key | quote }}}
{{- else }}
- name: TOLLGATE_REDIS_URL
  value: {{ default (printf "redis://%s.%s.svc.%s:6379" (ternary (printf "%s-redis" (include "tollgate.fullname" .)) "redis" .Values.bundledRedis.enabled) .Release.Namespace .Values.clusterDomain) $r.url | quote }}
{{- end }}
{{- else if eq $r.mode "cluster" }}
- name: TOLLGATE_REDIS_CLUSTER
  value: {{ required "redis.cluster.nodes: the seed nodes of the Redis Cluster" (join "," $r.cluster.nodes) | quote }}
{{- else if eq $r.mode "sentinel" }}
- name: TOLLGATE_REDIS_SENTINEL
  value: {{ required "redis.sentinel.addresses: the sentinels' addresses" (join "," $r.sentinel.addresses) | quote }}
- name: TOLLGATE_REDIS_SENTINEL_MASTER
  value: {{ required "redis.sentinel.masterName" $r.sentinel.masterName | quote }}
{{- else if eq $r.mode "memory" }}
{{- if gt (int .Values.replicaCount) 1 }}
{{- fail "redis.mode=memory keeps the buckets in one process: replicaCount must be 1" }}
{{- end }}
{{- else }}
{{- fail (printf "redis.mode: %q is none of standalone, cluster, sentinel, memory" $r.mode) }}
{{- end }}
{{- if ne $r.mode "memory" }}
- name: TOLLGATE_REDIS_TIMEOUT_MS
  value: {{ $r.timeoutMs | quote }}
- name: TOLLGATE_KEY_PREFIX
  value: {{ $r.keyPrefix | quote }}
{{- end }}
{{- if $r.tls.enabled }}
{{- if $r.tls.caKey }}
- name: TOLLGATE_REDIS_TLS_CA
  value: /etc/tollgate/redis-tls/{{ $r.tls.caKey }}
{{- end }}
{{- if $r.tls.clientCertificate }}
- name: TOLLGATE_REDIS_TLS_CERT
  value: /etc/tollgate/redis-tls/{{ $r.tls.certKey }}
- name: TOLLGATE_REDIS_TLS_KEY
  value: /etc/tollgate/redis-tls/{{ $r.tls.keyKey }}
{{- end }}
{{- end }}
{{- end -}}
